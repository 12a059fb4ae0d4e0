"""Admission of a request into the engine: its images encoded, one sequence per choice with its
grammar, token filter, adapter and weights version, handed to the replica with the least load.
A mixin of ``EngineCore``, kept apart so the loop's module stays about the loop."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from myserve.core.images import ImageEncoding, ImageSpan
from myserve.core.sequence import Sequence as Seq
from myserve.core.token_masks import TokenFilter
from myserve.grammar import LazyGrammars
from myserve.wire.pooling import Pooler

if TYPE_CHECKING:
    from myserve.core.adapters import AdapterRegistry
    from myserve.core.replica import Replica, Request


class RequestAdmission:
    """``_admit`` of ``EngineCore``: a request from the inbox becomes its sequences."""

    replicas: list[Replica]
    max_model_len: int
    vocab_size: int
    pooler: Pooler | None
    adapters: AdapterRegistry | None
    grammars: LazyGrammars
    image_encoder: ImageEncoding | None
    weights_slot: int
    _requests: dict[str, Request]
    _pending: int
    _pending_lock: threading.Lock
    _seeds: random.Random
    _version_root: Callable[[bytes | None], bytes | None]
    """EngineWeights': the root of a sequence's page hashes under the weights in use."""

    def _encode_images(self, req: Request) -> tuple[ImageSpan, ...]:
        """The request's images with their token embeddings: from the encoder cache, or through the
        vision tower now (on the engine thread, once per distinct image)."""
        if not req.images:
            return ()
        assert self.image_encoder is not None, "add() refuses images without an encoder"
        encoder = self.image_encoder
        spans = []
        for i in req.images:
            layout = encoder.layout(tuple(i.grid))
            assert layout is not None, "check_images refused it"
            embeddings = encoder.embeddings(i.key, i.array(), tuple(i.grid))
            spans.append(ImageSpan(i.key, i.offset, i.length, embeddings, encoder.whole_images, layout[2]))
        return tuple(spans)

    def _admit(self, req: Request) -> None:
        with self._pending_lock:
            self._pending -= 1
        max_len = min(self.max_model_len, len(req.prompt_ids) + (req.params.max_tokens or self.max_model_len))
        if req.params.pooling is not None:  # one past the prompt: its last token alone is still scheduled
            max_len = len(req.prompt_ids) + 1
        self._requests[req.request_id] = req
        # All choices of a request on one replica: they share its prompt pages.
        req.replica = min(self.replicas, key=lambda r: r.load)
        token_filter = TokenFilter(req.params, self.vocab_size) if req.params.masks_tokens else None
        images = self._encode_images(req)
        for choice in range(req.params.n):
            parent = req.seqs[0] if req.seqs else None
            seed = self._seeds.getrandbits(32) if req.params.seed is None else None
            seq = Seq(req.request_id, choice, req.prompt_ids, req.params, max_len, parent=parent, seed=seed)
            seq.pool_type = self.pooler.type if req.params.pooling and self.pooler else None
            req.seqs.append(seq)
            seq.token_filter = token_filter
            seq.images = images
            seq.hash_root = self._version_root(self.adapters.hash_root(req.params.adapter) if self.adapters else None)
            seq.weights = self.weights_slot
            if req.params.grammar is not None:
                matcher = self.grammars().matcher(req.params.grammar)
                if req.params.grammar_after:
                    seq.pending_matcher = matcher
                else:
                    seq.matcher = matcher
            req.replica.scheduler.add(seq)
