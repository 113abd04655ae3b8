"""`make` installs torch's CPU build also where no CPU wheel lies at hand (from TORCH_INDEX)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def local_torch_wheel(into: Path) -> Path:
    """The CPU wheel pip finds through this machine's own configuration (what `make` used here)."""
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-index", "--no-deps", "--only-binary=:all:",
                        "-d", str(into), "torch==2.13.0"], capture_output=True, text=True, timeout=600)
    wheels = list(into.glob("torch-2.13.0*.whl"))
    if p.returncode or not wheels:
        pytest.skip("no local torch wheel to stand in for PyTorch's CPU index")
    return wheels[0]


@pytest.mark.slow
def test_without_a_local_cpu_wheel_make_takes_torch_from_the_cpu_index(tmp_path):
    wheel = local_torch_wheel(tmp_path / "wheels")
    index = tmp_path / "index" / "torch"                   # a PEP 503 index, as PyTorch's CPU index is
    index.mkdir(parents=True)
    (index / "index.html").write_text(f'<a href="{wheel.as_uri()}">{wheel.name}</a>\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull                    # no find-links: nothing at hand
    venv.create(tmp_path / "venv", with_pip=True)
    py = tmp_path / "venv" / "bin" / "python"
    p = subprocess.run(["make", "-C", str(REPO), f"VENV={tmp_path / 'venv'}", f"PY={py}",
                        f"TORCH_INDEX={(tmp_path / 'index').as_uri()}", str(tmp_path / "venv" / ".torch")],
                       capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert f"--index-url \"{(tmp_path / 'index').as_uri()}\"" in p.stdout
    version = subprocess.run([py, "-c", "import importlib.metadata as m; print(m.version('torch'))"],
                             capture_output=True, text=True, timeout=60, env=env).stdout.strip()
    assert re.fullmatch(r"2\.13\.0\+cpu", version), version
