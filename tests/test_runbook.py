"""RUNBOOK.md, every `sh` block in order, as root in a container booted with systemd: the Debian
package installed with apt, a vLLM fill under the shipped unit, a reload, an upgrade of the
engine's environment and one of fast-start, a crash, a vLLM server with a hot standby and its
failover drill, the purge. Each block runs under `bash -euo pipefail`; its own
commands are the checks (status exits 1 unless every model is cached, verify 1 on a mismatch,
grep 1 on no match). The test machine's differences are put in the text before it runs
(`HERE`): the CPU device, synthetic checkpoints, engine environments whose vLLM is the test's."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from container import RunEnv
from devtools import synth
from test_deb import UPGRADE, VERSION, apt_container, debs  # noqa: F401  (debs: the fixture)
from test_systemd import journal, readable

pytestmark = pytest.mark.slow      # builds the Debian package, fills with vLLM in a container

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"^```sh\n(.*?)^```$", re.S | re.M)
# The runbook's GPU host -> this container. Longer paths first: one is a prefix of another.
HERE = {'device = "cuda"': 'device = "cpu"', "./fast-start_*_all.deb": f"/srv/debs/fast-start_{VERSION}_all.deb",
        "./new/fast-start_*_all.deb": f"/srv/debs/fast-start_{UPGRADE}_all.deb",
        "/opt/vllm-new/.venv/bin/python": "/opt/engine-new/bin/python",
        "/opt/vllm/.venv/bin/python": "/opt/engine/bin/python",
        "/models/Qwen3-8B-2512": "/srv/model-2512", "/models/Qwen3-8B": "/srv/model",
        # vLLM's CPU build: its server's module (its CLI cannot name its version), eager, small.
        "vllm serve ": "-m vllm.entrypoints.openai.api_server --model ",
        "Environment=CUDA_VISIBLE_DEVICES=0": "Environment=VLLM_CPU_KVCACHE_SPACE=1",
        """'{"fallback": false}'""": """'{"fallback": false}' --enforce-eager --max-model-len 256"""}


def blocks() -> list[str]:
    text = (REPO / "RUNBOOK.md").read_text()
    found = BLOCK.findall(text)
    assert len(found) == text.count("```sh"), "a sh block the pattern missed"
    for a, b in HERE.items():
        found = [f.replace(a, b) for f in found]
    return found


def test_the_runbook_finds_its_blocks_and_the_container_stands_in_for_each_host_path():
    text = "".join(blocks())
    assert len(blocks()) >= 10 and "apt-get install" in text and "apt-get purge" in text
    assert "/models/" not in text and "/opt/vllm" not in text and '"cuda"' not in text


@pytest.fixture(scope="module")
def box(debs, tmp_path_factory, llama):  # noqa: F811
    if not os.environ.get("CI"):
        pytest.importorskip("vllm")
    tmp = tmp_path_factory.mktemp("runbook")
    env = RunEnv(REPO)
    model = readable(shutil.copytree(llama, tmp / "model"))
    newer = readable(synth.write_checkpoint(tmp / "model-2512", synth.Shape(**json_shape(llama)), files=1, seed=5))
    synth.write_tokenizer(newer, json_shape(llama)["vocab_size"])      # the standby's server takes text
    c = apt_container(tmp, env, debs, {str(model): "/srv/model", str(newer): "/srv/model-2512"})
    # The test's own settings for every instance (the runbook's uninstall removes the folder).
    c.run("mkdir", "-p", "/etc/systemd/system/fast-start@.service.d")
    c.run("sh", "-c", "cat > /etc/systemd/system/fast-start@.service.d/test.conf <<'EOF'\n[Service]\nRestartSec=1\n"
          f"{env.service_dropin}EOF")
    # Two engine environments: fresh venvs of the test's interpreter that see the test's
    # packages (torch, vLLM) through a .pth line; install-engine puts fast-start into each.
    site = next(p for p in sys.path if p.endswith("site-packages") and p.startswith(sys.prefix))
    base = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    for venv in ("/opt/engine", "/opt/engine-new"):
        c.run(str(base), "-m", "venv", venv, timeout=300)
        packages = c.run(f"{venv}/bin/python", "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").stdout
        c.run("sh", "-c", f"echo {site} > {packages.strip()}/test-packages.pth")
    yield c
    c.close()


def json_shape(folder: Path) -> dict:
    """The synth.Shape of a synthetic Llama checkpoint, from its config.json."""
    cfg = json.loads((folder / "config.json").read_text())
    return {"hidden_size": cfg["hidden_size"], "num_layers": cfg["num_hidden_layers"],
            "num_heads": cfg["num_attention_heads"], "num_kv_heads": cfg["num_key_value_heads"],
            "head_dim": cfg["head_dim"], "intermediate_size": cfg["intermediate_size"],
            "vocab_size": cfg["vocab_size"], "tie_word_embeddings": cfg["tie_word_embeddings"]}


def test_every_block_of_the_runbook_runs_in_order(box):
    for i, block in enumerate(blocks()):
        p = box.run("bash", "-euo", "pipefail", "-c", block, check=False, timeout=600)
        assert p.returncode == 0, (f"block {i + 1} exited {p.returncode}:\n{block}\n"
                                   f"--- stdout\n{p.stdout[-3000:]}\n"
                                   f"--- stderr\n{p.stderr[-3000:]}\n"
                                   f"--- journal\n{_notable(journal(box, 'fast-start@0'))}")


def _notable(log: str) -> str:
    """The daemon's own lines of a journal (vLLM's fill logs thousands)."""
    return "\n".join(ln for ln in log.splitlines() if not ln.startswith(("(MainProcess", "[W", "Loading"))
                      and ln.strip())[-4000:]
