"""Only the engine core reaches the front end's sockets: a foreign local process (another user's, or
another of our own user's) that finds their names and connects gets no request and can inject no
output, while the server's own requests all complete."""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_core_process import Server

from myserve.frontend.peer_guard import allowed, peer_credentials
from myserve.wire import messages as msg

# Finds the front end's abstract socket names the way an attacker would (/proc/net/unix), drops to
# another uid if asked (after importing zmq: that user cannot read root's Python), connects a PULL
# to every to-core socket and a PUSH to every from-core one, then for a few seconds takes what
# comes and pushes a forged `Died` (which would end the server if delivered). Prints a JSON summary.
INTRUDER = r"""
import json, os, sys, time, zmq
uid, seconds, forged, prefix = int(sys.argv[1]), float(sys.argv[2]), bytes.fromhex(sys.argv[3]), sys.argv[4]
names = sorted({line.split()[-1] for line in open("/proc/net/unix") if prefix in line})
if uid != os.getuid():
    os.setuid(uid)
ctx = zmq.Context()
pulls, pushes = [], []
for name in names:
    kind = zmq.PULL if "to-core" in name else zmq.PUSH
    s = ctx.socket(kind); s.linger = 0; s.immediate = 1  # queue only on a connection made
    s.connect("ipc://" + name)
    (pulls if kind == zmq.PULL else pushes).append(s)
got = sent = 0
deadline = time.monotonic() + seconds
while time.monotonic() < deadline:
    for s in pulls:
        while s.poll(0):
            s.recv(); got += 1
    for s in pushes:
        try:
            s.send(forged, zmq.NOBLOCK); sent += 1
        except zmq.Again:
            pass
    time.sleep(0.05)
print(json.dumps({"uid": os.getuid(), "names": names, "received": got, "injected": sent}))
"""


def test_peer_credentials_are_read_from_libzmq_s_address() -> None:
    assert peer_credentials(b"localhost:1000:1000:4242") == (1000, 4242)
    assert peer_credentials(b":501:20:") == (501, None)  # macOS: no pid
    assert peer_credentials(b"127.0.0.1") is None and peer_credentials(b"") is None
    assert allowed(b"localhost:1000:1000:4242", 1000, 4242)
    assert not allowed(b"localhost:1000:1000:4243", 1000, 4242), "another process of our user"
    assert not allowed(b"localhost:65534:65534:4242", 1000, 4242), "another user"
    assert not allowed(b"127.0.0.1", 1000, 4242), "no credentials: refused"


def _intrude(uid: int, seconds: float, front_end_pid: int) -> subprocess.Popen:
    forged = msg.encoder.encode(msg.Died("forged by an intruder")).hex()
    prefix = f"@myserve-{front_end_pid}-"  # this server's sockets, not another test's
    return subprocess.Popen(
        [sys.executable, "-c", INTRUDER, str(uid), str(seconds), forged, prefix], stdout=subprocess.PIPE, text=True
    )


@pytest.mark.slow
def test_a_foreign_process_gets_no_request_and_injects_nothing(tiny_checkpoints) -> None:
    server = Server(tiny_checkpoints["llama3"])
    try:
        uids = [os.getuid()] + ([65534] if os.getuid() == 0 else [])  # root can also be another user
        intruders = [_intrude(uid, 6.0, server.proc.pid) for uid in uids]
        time.sleep(1.5)  # connected (or refused) before the requests come
        body = {"model": "tiny", "prompt": [40, 41, 42], "max_tokens": 8, "temperature": 0}
        url = f"{server.url}/v1/completions"
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(lambda _: httpx.post(url, json=body, timeout=60), range(4)))
        assert [r.status_code for r in replies] == [200] * 4, [r.text for r in replies]
        assert len({r.json()["choices"][0]["text"] for r in replies}) == 1
        reports = [json.loads(p.communicate(timeout=30)[0]) for p in intruders]
        for report in reports:
            assert len(report["names"]) == 2, report  # it found both sockets
            assert report["received"] == 0 and report["injected"] == 0, report
        assert [r["uid"] for r in reports] == uids
        # The forged `Died` never arrived: the server still serves.
        assert httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        assert httpx.post(url, json=body, timeout=60).status_code == 200
        refused = re.findall(r"refused a connection to the engine core's sockets from \S+:(\d+):\d+:(\d+)", server.log)
        assert {int(uid) for uid, _ in refused} == set(uids), server.log[-3000:]
        assert {int(pid) for _, pid in refused} == {p.pid for p in intruders}
        assert Path(f"/proc/{server.core}").exists()
    finally:
        server.stop()
