"""vLLM's own OpenAI-server tests against vLLM's server and against Sluice, side by side.

    python bench/vllm_suite.py                      # both servers, every family
    python bench/vllm_suite.py --suite responses anthropic
    python bench/vllm_suite.py --systems sluice -k logprobs

The tests come from vLLM's source distribution for the installed vLLM version, fetched from
PyPI at run time (cached under ~/.cache/sluice) and never copied into this repository. Three
families of `tests/entrypoints`: Chat Completions and Completions (`openai/`), the Responses API
(`openai/responses/`) and Anthropic's Messages API (`anthropic/`). Only the tests that talk
HTTP run: those whose fixtures start vLLM's test server (`RemoteOpenAIServer`). Instead of
starting `vllm serve`, that class is pointed at a server already running on the demo model,
served under the name the test module asks for: first vLLM's own server, then Sluice, with the
same engine settings. Tests that need a real model's words (its tokenizer, its LoRA adapters,
its reasoning format) fail on both alike; the comparison is the point.

Writes a JSON report (per test: the outcome on each server, and Sluice's failure message
where vLLM's server passed; per file: the tests run and passed on each) and prints the totals
per family.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import defaultdict
from contextlib import contextmanager
from datetime import date
from importlib import metadata
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CACHE = Path.home() / ".cache" / "sluice"
sys.path.insert(0, str(ROOT))

# Paths under vLLM's tests/entrypoints, by family: the files whose fixtures start a server.
SUITES = {
    # Left out: gpt-oss/Harmony, multimodal, prompt embeds, LoRA resolvers, tensorizer and
    # lm-eval, which need a particular real model or feature.
    "chat": (
        "openai/chat_completion/test_chat.py",
        "openai/chat_completion/test_chat_completion.py",
        "openai/chat_completion/test_completion_with_function_calling.py",
        "openai/chat_completion/test_chat_logit_bias_validation.py",
        "openai/chat_completion/test_chat_echo.py",
        "openai/chat_completion/test_logprob_token_ids.py",
        "openai/chat_completion/test_include_reasoning.py",
        "openai/chat_completion/test_batched_chat_completions.py",
        "openai/chat_completion/test_root_path.py",
        "openai/chat_completion/test_enable_force_include_usage.py",
        "openai/completion/test_completion.py",
        "openai/completion/test_prompt_validation.py",
        "openai/completion/test_token_in_token_out.py",
        "openai/test_return_token_ids.py",
        "openai/test_return_tokens_as_ids.py",
        "openai/test_chunked_prompt.py",
    ),
    # Left out: test_harmony.py and test_mcp_tools.py (gpt-oss: Harmony's format, its
    # browser, Python and MCP tool servers), test_parsable_context.py (`--tool-server demo`:
    # gpt_oss's Python tool run through uv, vLLM's experimental parser context). The rest of
    # the directory are unit tests of vLLM's own classes, with no server.
    "responses": (
        "openai/responses/test_basic.py",
        "openai/responses/test_function_call.py",
        "openai/responses/test_namespace_tool_separator.py",
        "openai/responses/test_simple.py",
        "openai/responses/test_stateful.py",
        "openai/responses/test_structured_output.py",
    ),
    # The directory's other files are unit tests of vLLM's conversion, with no server.
    "anthropic": ("anthropic/test_messages.py",),
    # LoRA adapters as models: the models listing, and loading at runtime (issue #33). Their
    # Qwen3 adapters are the demo adapter (`LORA`): the tests of a real adapter's words fail
    # on both servers alike. Left out: LoRA resolvers (a plugin that fetches adapters).
    "lora": ("openai/models/test_models.py", "serve/lora/test_lora_adapters.py"),
}
DEFAULT_MODEL_NAME = "tiny"  # for a module that names no model
# Both servers: the demo model, as the comparison ran it, plus tool calls read by
# vLLM's pythonic parser (the demo tokenizer has no tool-call tokens).
ENGINE = {"max_model_len": 1024, "dtype": "bfloat16", "enforce_eager": True}
TOOLS = ["--tool-call-parser", "pythonic", "--enable-auto-tool-choice"]
# vLLM's server keeps Responses (store, background, retrieve, cancel) only with this set, as
# the Responses tests' own fixtures set it; Sluice's store is on by default. vLLM's serves
# /v1/load_lora_adapter only with runtime LoRA updating allowed, as the LoRA tests set it.
SERVER_ENV = {
    "vllm": {"VLLM_ENABLE_RESPONSES_API_STORE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    "sluice": {},
}
# For the LoRA family, both servers as the tests' fixtures start theirs: the adapter as
# `qwen3-lora`, rank up to 64, two adapters held in the engine at once.
LORA_FLAGS = ["--enable-lora", "--max-lora-rank", "64", "--max-cpu-loras", "2"]
# Sluice loads adapters at runtime for an admin key only: the tests' client's key is one.
SLUICE_LORA_CONFIG = {"tenants": {"suite": {"api_keys": ["token-abc123"], "admin": True}}}
KEY = {"Authorization": "Bearer token-abc123"}  # (what the tests' clients send)

# Written over vLLM's tests/conftest.py (whose imports need vLLM's whole test environment).
CONFTEST = '''
"""By bench/vllm_suite.py: RemoteOpenAIServer points at the server already running at
SLUICE_SUITE_URL; only tests whose fixtures start that server run."""
import inspect
import os
import tempfile

import huggingface_hub
import pytest

import tests.utils as vllm_test_utils

_URL = os.environ["SLUICE_SUITE_URL"]
# Server arguments are the running server's business. LoRA files cannot be downloaded here:
# every adapter a test asks for is the demo adapter (SLUICE_SUITE_LORA), else an empty folder.
def _download(*args, **kwargs):
    return os.environ.get("SLUICE_SUITE_LORA") or tempfile.mkdtemp()


huggingface_hub.snapshot_download = _download
huggingface_hub.HfApi.snapshot_download = _download


class RunningServer(vllm_test_utils.RemoteOpenAIServer):
    def __init__(self, model, vllm_serve_args, *args, **kwargs):
        host, port = _URL.rsplit("/", 1)[1].rsplit(":", 1)
        self.host, self.port, self.uds = host, int(port), None
        self.show_hidden_metrics = False
        self._shutdown_complete = True

    def _shutdown(self):
        pass


vllm_test_utils.RemoteOpenAIServer = RunningServer
_MARKS = (
    "RemoteOpenAIServer",
    ".get_async_client(",
    ".get_client(",
    ".get_async_client_anthropic(",
    ".get_client_anthropic(",
    ".url_for(",
)


def _talks_http(item):
    sources = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)
    for name in getattr(item, "fixturenames", ()):
        for definition in (info.name2fixturedefs.get(name, ()) if info else ()):
            sources.append(definition.func)
    for function in sources:
        try:
            text = inspect.getsource(function)
        except (OSError, TypeError):
            continue
        if any(mark in text for mark in _MARKS):
            return True
    return False


def pytest_collection_modifyitems(config, items):
    keep = [item for item in items if _talks_http(item)]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep
'''


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__).split("+")[0]


def fetch_sdist(version: str) -> Path:
    """vLLM's source distribution from PyPI (its sha256 checked), cached."""
    target = CACHE / f"vllm-{version}.tar.gz"
    if target.is_file():
        return target
    request = urllib.request.Request(
        "https://pypi.org/simple/vllm/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        index = json.load(response)
    entry = next(f for f in index["files"] if f["filename"] == f"vllm-{version}.tar.gz")
    CACHE.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    with urllib.request.urlopen(entry["url"], timeout=600) as response, open(partial, "wb") as f:
        shutil.copyfileobj(response, f)
    digest = hashlib.sha256(partial.read_bytes()).hexdigest()
    if digest != entry["hashes"]["sha256"]:
        raise SystemExit(f"vllm-{version}.tar.gz: sha256 {digest} does not match PyPI's")
    partial.rename(target)
    return target


def extract_tests(sdist: Path, where: Path) -> Path:
    """vLLM's tests/__init__.py, utils.py and entrypoints/ into `where`/tests, our conftest
    in place of theirs; returns tests/entrypoints."""
    prefix = sdist.name.removesuffix(".tar.gz") + "/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "tests/")
            and (
                m.name in (prefix + "tests/__init__.py", prefix + "tests/utils.py")
                or m.name.startswith(prefix + "tests/entrypoints/")
            )
        ]
        for member in members:
            member.name = member.name[len(prefix) :]
        tar.extractall(where, members=members, filter="data")
    (where / "tests" / "conftest.py").write_text(CONFTEST)
    return where / "tests" / "entrypoints"


def model_name(test_file: Path) -> str:
    """The name a test module's requests ask for: the server's `--served-model-name` where
    the module sets one, else its MODEL_NAME, else the model its directory's conftest
    starts (the Responses tests' `server_with_store`)."""
    text = test_file.read_text()
    conftest = test_file.parent / "conftest.py"
    for pattern, source in (
        (r'"--served-model-name",\s*"([^"]+)"', text),
        (r'^MODEL_NAME = "([^"]+)"', text),
        (r'RemoteOpenAIServer\(\s*"([^"]+)"', conftest.read_text() if conftest.is_file() else ""),
    ):
        found = re.search(pattern, source, re.M)
        if found:
            return found.group(1)
    return DEFAULT_MODEL_NAME


def server_command(
    system: str, model: Path, name: str, port: int, lora: Path | None = None
) -> list[str]:
    """`lora`: serve the demo adapter, as the LoRA family's fixtures serve theirs."""
    adapters = [] if lora is None else [*LORA_FLAGS, "--lora-modules", f"qwen3-lora={lora}"]
    # (vLLM 0.32's CPU LoRA in bfloat16 dies on some hosts: the LoRA family runs in float32.)
    engine = ENGINE if lora is None else {**ENGINE, "dtype": "float32"}
    if system == "vllm":
        flags = [
            f"--{key.replace('_', '-')}" + ("" if value is True else f"={value}")
            for key, value in engine.items()
        ]
        return [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model),
            "--served-model-name",
            name,
            "--port",
            str(port),
            *flags,
            *TOOLS,
            *adapters,
        ]
    engine_args = [
        arg
        for key, value in engine.items()
        for arg in ("--engine-arg", f"{key}={str(value).lower()}")
    ]
    return [
        sys.executable,
        "-m",
        "server.cli",
        "serve",
        "--model",
        str(model),
        "--served-model-name",
        name,
        "--port",
        str(port),
        *engine_args,
        *TOOLS,
        *adapters,
        *(["--config", _sluice_lora_config()] if lora is not None else []),
        "--data-dir",
        tempfile.mkdtemp(prefix="sluice-bench-"),
    ]


def _sluice_lora_config() -> str:
    path = Path(tempfile.mkdtemp(prefix="sluice-bench-")) / "sluice.json"
    path.write_text(json.dumps(SLUICE_LORA_CONFIG))
    return str(path)


@contextmanager
def running(system: str, model: Path, name: str, log: Path, lora: Path | None = None):  # type: ignore[no-untyped-def]
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    with open(log, "ab") as out:
        # Its own process group, not its own session (see tests/conftest.py).
        proc = subprocess.Popen(
            server_command(system, model, name, port, lora),
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **SERVER_ENV[system]},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"{system} exited with {proc.returncode}; see {log}")
            try:
                if (
                    httpx.get(url + "/health", timeout=2).status_code == 200
                    and httpx.get(url + "/v1/models", headers=KEY, timeout=2).status_code == 200
                ):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{system} not up in 300 s; see {log}")
            time.sleep(0.5)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_pytest(
    where: Path,
    files: list[Path],
    url: str,
    junit: Path,
    keyword: str | None,
    lora: Path | None = None,
) -> None:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(where),
        "--timeout",
        "180",
        "--junitxml",
        str(junit),
        *(["-k", keyword] if keyword else []),
        *map(str, files),
    ]
    subprocess.run(
        command,
        cwd=where,
        env={
            **os.environ,
            "SLUICE_SUITE_URL": url,
            "PYTHONPATH": str(where),
            **({} if lora is None else {"SLUICE_SUITE_LORA": str(lora)}),
        },
        check=False,
    )


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """Per test id: (passed|failed|skipped, the first line of the failure)."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            element = case.find(tag)
            if element is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                message = (
                    (element.get("message") or "").splitlines()[0][:300]
                    if (element.get("message"))
                    else ""
                )
                break
        results[test] = (outcome, message)
    return results


def test_module(path: str) -> str:
    """The junit classname of a test file's tests (a path under tests/entrypoints)."""
    return "tests.entrypoints." + path.removesuffix(".py").replace("/", ".")


def tally(
    files: list[str], results: dict[str, dict[str, tuple[str, str]]]
) -> dict[str, dict[str, Any]]:
    """Per file: its family, the tests run (on either server) and those passed on each."""
    family = {path: name for name, paths in SUITES.items() for path in paths}
    tests = set().union(*(r.keys() for r in results.values()))
    by_file = {}
    for path in files:
        module = test_module(path)
        mine = [t for t in tests if t.split("::")[0] == module or t.startswith(module + ".")]
        by_file[path] = {
            "suite": family.get(path, "other"),
            "tests": len(mine),
            "passed": {
                system: sum(1 for t in mine if r.get(t, ("",))[0] == "passed")
                for system, r in results.items()
            },
        }
    return by_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--systems", nargs="+", default=["vllm", "sluice"], choices=["vllm", "sluice"]
    )
    parser.add_argument(
        "--suite",
        nargs="+",
        default=["all"],
        choices=[*SUITES, "all"],
        help="families of tests to run (default: all)",
    )
    parser.add_argument(
        "--files",
        nargs="+",
        default=None,
        help="paths under vLLM's tests/entrypoints, instead of --suite's",
    )
    parser.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    parser.add_argument("--work", type=Path, default=Path("/tmp/sluice-vllm-suite"))
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results" / f"vllm-suite-{date.today()}.json"
    )
    args = parser.parse_args()
    suites = list(SUITES) if "all" in args.suite else args.suite
    files = args.files or [path for name in suites for path in SUITES[name]]

    from engine_adapters.demo_model import build_demo_adapter, build_demo_model

    version = vllm_version()
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    suite = extract_tests(fetch_sdist(version), args.work)
    model = build_demo_model(CACHE / "demo-model")
    adapter = build_demo_adapter(CACHE / "demo-lora", model)
    groups: dict[str, list[Path]] = defaultdict(list)
    for path in files:
        groups[model_name(suite / path)].append(suite / path)

    results: dict[str, dict[str, tuple[str, str]]] = {s: {} for s in args.systems}
    for index, (name, paths) in enumerate(groups.items()):
        for system in args.systems:
            junit = args.work / f"{system}-{index}.xml"
            print(f"== {system}, served as {name}: {len(paths)} file(s)", flush=True)
            lora = (
                adapter
                if any(p.relative_to(suite).as_posix() in SUITES["lora"] for p in paths)
                else None
            )
            with running(system, model, name, args.work / f"{system}.log", lora) as url:
                run_pytest(args.work, paths, url, junit, args.keyword, lora)
            if junit.is_file():
                results[system].update(outcomes(junit))

    tests = sorted(set().union(*(r.keys() for r in results.values())))
    by_file = tally(files, results)
    by_suite: dict[str, dict[str, Any]] = {}
    for counts in by_file.values():
        totals = by_suite.setdefault(
            counts["suite"], {"tests": 0, "passed": dict.fromkeys(args.systems, 0)}
        )
        totals["tests"] += counts["tests"]
        for system, passed in counts["passed"].items():
            totals["passed"][system] += passed
    report: dict[str, Any] = {
        "vllm_version": version,
        "sluice_version": metadata.version("sluice-server"),
        "date": str(date.today()),
        "files": files,
        "keyword": args.keyword,
        "passed": {s: sum(1 for o, _ in r.values() if o == "passed") for s, r in results.items()},
        "by_suite": by_suite,
        "by_file": by_file,
        "tests": {
            t: {s: results[s].get(t, ("absent", ""))[0] for s in args.systems} for t in tests
        },
    }
    if {"vllm", "sluice"} <= set(args.systems):
        report["sluice_fails_where_vllm_passes"] = {
            t: results["sluice"].get(t, ("absent", ""))[1]
            for t in tests
            if results["vllm"].get(t, ("",))[0] == "passed"
            and results["sluice"].get(t, ("",))[0] != "passed"
        }
        report["sluice_passes_where_vllm_fails"] = [
            t
            for t in tests
            if results["sluice"].get(t, ("",))[0] == "passed"
            and results["vllm"].get(t, ("",))[0] != "passed"
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({k: report[k] for k in ("vllm_version", "passed", "by_suite")}, indent=1))
    for test, message in report.get("sluice_fails_where_vllm_passes", {}).items():
        print(f"  sluice fails, vllm passes: {test}: {message}")
    print(f"report: {args.out}")


if __name__ == "__main__":
    main()
