"""The output processor on a thread of its own, for an in-process ``GenerationService``.

The engine thread hands each iteration's token deltas to ``put`` (a queue append) and goes on to
its next step; this thread detokenizes them, applies stop strings and delivers text deltas to the
streams (``OutputProcessor``). The engine thread never detokenizes, as in the server, where the
core ships token ids to the front end's process. Several iterations' deltas queued while this
thread was busy are processed in one pass (one wake-up of each event loop).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

from myserve.frontend.output_processor import OutputProcessor
from myserve.wire.outputs import RequestOutput

logger = logging.getLogger(__name__)


class OutputThread:
    """A daemon thread that runs ``processor.process`` on the deltas ``put`` hands it, in order."""

    def __init__(self, processor: OutputProcessor, name: str = "myserve-outputs"):
        self.processor = processor
        self.seconds = 0.0
        """Thread time spent processing (detokenizing, stop strings, delivering): ``bench.host``."""
        self._queue: queue.SimpleQueue[Sequence[RequestOutput] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, outputs: Sequence[RequestOutput]) -> None:
        """Queue one iteration's deltas (any thread; the engine's ``sink``)."""
        self._queue.put(outputs)

    def close(self, timeout: float = 30.0) -> None:
        """Process what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            while True:  # everything queued meanwhile, in one pass
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = None in batch
            t = time.thread_time()
            try:
                self.processor.process(out for outputs in batch if outputs is not None for out in outputs)
            except Exception:  # a delta that breaks the processor must not stop every other stream
                logger.exception("output processing failed")
            self.seconds += time.thread_time() - t
            if closing:
                return
