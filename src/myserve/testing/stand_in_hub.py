"""A stand-in Hugging Face Hub for tests: local directories served as model repos over plain HTTP.

``huggingface_hub.snapshot_download`` (and ``hf_hub_download``) pointed at it download a directory's
files as if it were a Hub model repo, into the ordinary cache layout. It serves what huggingface_hub
2.4.0 asks for, nothing more:

``GET /api/models/{repo_id}`` and ``GET /api/models/{repo_id}/revision/{revision}``
    The repo's info (``repo_info`` / ``model_info``): ``id``, ``sha`` (the commit), ``siblings``.
``GET /api/models/{repo_id}/tree/{revision}[/{path}]?recursive=...&cursor=...``
    The tree listing (``list_repo_tree``): files (``type``, ``path``, ``size``, ``oid``) and
    directories, ``page_size`` entries a page, the next page named by a ``Link: <...>; rel="next"``
    header, as the Hub paginates.
``HEAD`` / ``GET /{repo_id}/resolve/{revision}/{filename}``
    The file itself (``Range`` requests included), with ``ETag`` (the file's git blob sha1, as the
    Hub gives for files outside LFS), ``X-Repo-Commit`` and ``Content-Length``. No ``X-Xet-Hash`` and
    no ``lfs`` entries anywhere, so huggingface_hub never takes its Xet or LFS paths.

Each repo has one branch, ``main``; its commit sha is the sha1 of the repo id and every file's path,
size and blob sha1, so it is stable across runs and changes when a file does. ``main`` or that sha
is a revision; anything else answers ``404`` with ``X-Error-Code: RevisionNotFound`` (huggingface_hub
raises ``RevisionNotFoundError``). An unknown repo answers ``404`` with ``X-Error-Code: RepoNotFound``
(``RepositoryNotFoundError``); an unknown file ``404`` with ``X-Error-Code: EntryNotFound``
(``RemoteEntryNotFoundError``). With ``token`` set, a request without ``Authorization: Bearer <token>``
answers ``401`` as the Hub answers an anonymous request for a private repo (``X-Error-Code:
RepoNotFound``, so ``RepositoryNotFoundError``), and one with another token ``401`` "Invalid credentials
in Authorization header" (a plain ``HfHubHTTPError`` whose response status is 401).

Point huggingface_hub at ``StandInHub.url`` with ``endpoint=`` (``snapshot_download``,
``hf_hub_download``, ``HfApi``) in process, or with ``HF_ENDPOINT`` in a child process's environment
(huggingface_hub reads it once, at import). Patching ``huggingface_hub.constants.ENDPOINT`` alone is
not enough: ``constants.HUGGINGFACE_CO_URL_TEMPLATE`` was built from it at import.

Usage::

    with StandInHub({"org/tiny-llama": checkpoint_dir}) as hub:
        path = snapshot_download("org/tiny-llama", cache_dir=cache, endpoint=hub.url)
    assert not any("/resolve/" in p for p in hub.requests)
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any
from urllib.parse import unquote

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response

__all__ = ["StandInHub", "hub_app"]

_MAIN = "main"
_CHUNK = 1 << 20
_Scope = MutableMapping[str, Any]
_Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
_Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
_ASGIApp = Callable[[_Scope, _Receive, _Send], Awaitable[None]]


@dataclass(frozen=True)
class _File:
    """One file of a repo: its repo path (``/``-separated), local path, size and git blob sha1."""

    path: str
    local: Path
    size: int
    blob_id: str


@dataclass(frozen=True)
class _Snapshot:
    """A repo's files as they are now, and the commit sha they make."""

    repo_id: str
    sha: str
    files: dict[str, _File]

    def folders(self) -> set[str]:
        """Every directory that holds a file, at any depth ("a", "a/b", ...); the root is not one."""
        out: set[str] = set()
        for path in self.files:
            parts = path.split("/")[:-1]
            out.update("/".join(parts[: i + 1]) for i in range(len(parts)))
        return out


class _Repos:
    """The repos served: reads each directory on every request, hashing a file again only when it changed."""

    def __init__(self, repos: dict[str, Path]) -> None:
        self._dirs = {repo_id: Path(d) for repo_id, d in repos.items()}
        self._blob_ids: dict[tuple[str, int, int], str] = {}
        self._lock = threading.Lock()

    def __contains__(self, repo_id: str) -> bool:
        return repo_id in self._dirs

    def _blob_id(self, local: Path, stat: os.stat_result) -> str:
        key = (str(local), stat.st_size, stat.st_mtime_ns)
        with self._lock:
            cached = self._blob_ids.get(key)
        if cached is not None:
            return cached
        digest = hashlib.sha1(b"blob %d\0" % stat.st_size, usedforsecurity=False)
        with local.open("rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        with self._lock:
            self._blob_ids[key] = digest.hexdigest()
        return digest.hexdigest()

    def snapshot(self, repo_id: str) -> _Snapshot:
        """The repo's files now (everything under its directory but ``.git/``) and their commit sha."""
        root = self._dirs[repo_id]
        files: dict[str, _File] = {}
        for local in sorted(root.rglob("*")):
            rel = local.relative_to(root)
            if ".git" in rel.parts or not local.is_file():
                continue
            stat = local.stat()
            path = rel.as_posix()
            files[path] = _File(path, local, stat.st_size, self._blob_id(local, stat))
        commit = hashlib.sha1(repo_id.encode(), usedforsecurity=False)
        for f in files.values():
            commit.update(f"\0{f.path}\0{f.size}\0{f.blob_id}".encode())
        return _Snapshot(repo_id, commit.hexdigest(), files)


def _error(status: int, code: str | None, message: str, headers: dict[str, str] | None = None) -> Response:
    """An error as the Hub sends it: ``X-Error-Code`` / ``X-Error-Message`` headers and ``{"error": ...}``."""
    out = {"X-Error-Message": message, **(headers or {})}
    if code is not None:
        out["X-Error-Code"] = code
    return JSONResponse({"error": message}, status_code=status, headers=out)


def _split_repo(repos: _Repos, segments: list[str], keyword: str) -> tuple[str, list[str]] | None:
    """``segments`` = repo id (1 or 2 segments), ``keyword``, rest: the repo id and the rest, or None.

    A known repo id wins; otherwise the ``namespace/name`` reading, so that an unknown repo is reported
    as such. None when ``keyword`` is not where a repo id would end.
    """
    candidates = [n for n in (2, 1) if len(segments) > n and segments[n] == keyword]
    for n in candidates:
        if "/".join(segments[:n]) in repos:
            return "/".join(segments[:n]), segments[n + 1 :]
    if candidates:
        n = candidates[0]
        return "/".join(segments[:n]), segments[n + 1 :]
    return None


def _is_true(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true", "yes")


def hub_app(repos: dict[str, Path], token: str | None = None, page_size: int = 1000) -> FastAPI:
    """A FastAPI app that serves ``repos`` (repo id -> local directory) as Hub model repos.

    ``token``: when set, every request must carry ``Authorization: Bearer <token>`` (else ``401``).
    ``page_size``: tree listing entries per page (the Hub's is 1000); lower it to exercise pagination.
    The directories are read at each request, so files written after the app was made are served.
    See the module docstring for the endpoints and the errors.
    """
    served = _Repos(repos)
    app = FastAPI(title="stand-in Hugging Face Hub", openapi_url=None, docs_url=None, redoc_url=None)

    def revision_of(snap: _Snapshot, revision: str) -> Response | None:
        """None if ``revision`` names the repo's one commit, else the Hub's RevisionNotFound answer."""
        if revision in (_MAIN, snap.sha):
            return None
        return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")

    def repo_info(snap: _Snapshot, revision: str) -> Response:
        if (wrong := revision_of(snap, revision)) is not None:
            return wrong
        siblings = [{"rfilename": f.path, "size": f.size, "blobId": f.blob_id} for f in snap.files.values()]
        body = {"id": snap.repo_id, "modelId": snap.repo_id, "sha": snap.sha, "private": token is not None}
        return JSONResponse({**body, "gated": False, "disabled": False, "tags": [], "siblings": siblings})

    def tree(request: Request, snap: _Snapshot, revision: str, folder: str) -> Response:
        if (wrong := revision_of(snap, revision)) is not None:
            return wrong
        folders = snap.folders()
        if folder and folder not in folders:
            return _error(404, "EntryNotFound", f"{folder} does not exist on {revision}")
        prefix = f"{folder}/" if folder else ""
        recursive = _is_true(request.query_params.get("recursive"))
        entries: list[dict[str, Any]] = []
        for path in sorted([*snap.files, *folders]):
            if not path.startswith(prefix) or (not recursive and "/" in path[len(prefix) :]):
                continue
            if path in snap.files:
                f = snap.files[path]
                entries.append({"type": "file", "oid": f.blob_id, "size": f.size, "path": path})
            else:
                oid = hashlib.sha1(f"{snap.sha}\0{path}".encode(), usedforsecurity=False).hexdigest()
                entries.append({"type": "directory", "oid": oid, "size": 0, "path": path})
        start = int(request.query_params.get("cursor", "0"))
        page, end = entries[start : start + page_size], start + page_size
        headers = {}
        if end < len(entries):
            headers["Link"] = f'<{request.url.include_query_params(cursor=end)}>; rel="next"'
        return JSONResponse(page, headers=headers)

    def resolve(snap: _Snapshot, revision: str, filename: str) -> Response:
        if (wrong := revision_of(snap, revision)) is not None:
            return wrong
        commit = {"X-Repo-Commit": snap.sha}
        f = snap.files.get(filename)
        if f is None:
            return _error(404, "EntryNotFound", f"{filename} does not exist on {revision}", commit)
        # FileResponse adds Content-Length (and Content-Range, answering a Range request) from the file itself.
        headers = {**commit, "ETag": f'"{f.blob_id}"'}
        return FileResponse(f.local, media_type="application/octet-stream", headers=headers)

    def unauthorized(request: Request) -> Response | None:
        if token is None:
            return None
        given = request.headers.get("authorization")
        if given is None:
            return _error(401, "RepoNotFound", "Invalid username or password.")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or value.strip() != token:
            return _error(401, None, "Invalid credentials in Authorization header")
        return None

    @app.api_route("/{_path:path}", methods=["GET", "HEAD"], include_in_schema=False)
    def dispatch(request: Request, _path: str) -> Response:
        """Routes on the raw path, so that a ``%2F`` inside a revision stays in its segment."""
        if (denied := unauthorized(request)) is not None:
            return denied
        raw = request.scope.get("raw_path") or request.url.path.encode()
        segments = [unquote(s) for s in raw.decode("latin-1").split("/")[1:]]
        not_found = _error(404, None, "Not Found")
        if segments[:2] == ["api", "models"]:
            rest = segments[2:]
            if 1 <= len(rest) <= 2 and "/".join(rest) in served:
                return repo_info(served.snapshot("/".join(rest)), _MAIN)
            for keyword in ("revision", "tree"):
                split = _split_repo(served, rest, keyword)
                if split is None:
                    continue
                repo_id, tail = split
                if repo_id not in served:
                    return _error(404, "RepoNotFound", "Repository not found")
                if not tail or (keyword == "revision" and len(tail) != 1):
                    return not_found
                snap = served.snapshot(repo_id)
                if keyword == "revision":
                    return repo_info(snap, tail[0])
                return tree(request, snap, tail[0], "/".join(tail[1:]).strip("/"))
            return _error(404, "RepoNotFound", "Repository not found")
        split = _split_repo(served, segments, "resolve")
        if split is None or len(split[1]) < 2:
            return not_found
        repo_id, tail = split
        if repo_id not in served:
            return _error(404, "RepoNotFound", "Repository not found")
        return resolve(served.snapshot(repo_id), tail[0], "/".join(tail[1:]))

    return app


class StandInHub:
    """``hub_app(repos, token)`` on uvicorn at ``127.0.0.1`` (a free port), in a background thread.

    A context manager: ``__enter__`` returns once the server accepts connections, ``__exit__`` stops it
    and waits for its thread. ``url`` (no trailing slash) is the endpoint to hand huggingface_hub.
    ``requests`` lists the path of every request received (percent-decoded, no query string), in order;
    ``calls`` the same as ``(method, path)`` pairs, so a test can tell a ``HEAD`` from a download.
    """

    def __init__(self, repos: dict[str, Path], token: str | None = None, page_size: int = 1000) -> None:
        self.app = hub_app(repos, token=token, page_size=page_size)
        self.requests: list[str] = []
        self.calls: list[tuple[str, str]] = []
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port: int = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            self._recording,
            interface="asgi3",
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    async def _recording(self, scope: _Scope, receive: _Receive, send: _Send) -> None:
        if scope["type"] == "http":
            self.requests.append(scope["path"])
            self.calls.append((scope["method"], scope["path"]))
        app: _ASGIApp = self.app
        await app(scope, receive, send)

    def start(self) -> StandInHub:
        """Starts serving; returns once the server is up (``RuntimeError`` if it does not come up in 10 s)."""
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the stand-in hub did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops serving and waits for the server thread (idempotent)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> StandInHub:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
