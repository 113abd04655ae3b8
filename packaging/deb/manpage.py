"""fast-start(8), generated from the CLI itself: `python3 packaging/deb/manpage.py > fast-start.8`.

Every command, option and help text comes from the click objects typer builds for
`fast_start.cli.app`, so the page cannot drift from `fast-start --help`. The Debian package's
build runs it with Debian's python3-typer; it works with any typer the CLI supports.
"""
from __future__ import annotations

import os
import sys
import time

import click
import typer.main

from fast_start import __version__
from fast_start.cli import app

NAME = "keep inference engines' weights resident on each GPU between restarts"
DESCRIPTION = """\
fast-start caches a model's weights on each GPU, converted to the engine's layout and cut
into the engine's tensor-parallel shard, and keeps them there between engine restarts. One
daemon per GPU (the systemd unit fast-start@N.service, which runs `fast-start daemon --gpu N`)
fills its cache from the models of /etc/fast-start/fast-start.toml and reports READY to
systemd once every model is cached. Engines ask it over a Unix socket in /run/fast-start and map
the weights; a restarted daemon takes its cache back from systemd's file descriptor store.

The fill worker runs in the engine's Python environment (worker_python in the config):
`fast-start install-engine PYTHON` installs the wheel this package ships there, with the vLLM
plugin, and needs no package index. This command and the daemon need only Python 3, typer and
rich."""
FILES = [
    ("/etc/fast-start/fast-start.toml", "the configuration (fast-start example-config prints every key)"),
    ("/run/fast-start/gpuN.sock", "the socket of GPU N's daemon"),
    ("/var/lib/fast-start/gpuN.evictions.json", "GPU N's eviction history, kept across restarts"),
    ("/var/cache/fast-start", "the fill worker's HOME and cache directory (vLLM, Triton)"),
    ("/lib/systemd/system/fast-start@.service", "the template unit: one instance per GPU"),
    ("/usr/share/doc/fast-start/RUNBOOK.md.gz", "the runbook (zless it): install, configure, check, rotate a "
     "model, upgrade the engine, recover from a crash, read the metrics, troubleshoot, uninstall"),
    ("/usr/share/doc/fast-start/operations.md.gz", "the reference behind the runbook: install, every "
     "command, GPUs, big models"),
    ("/usr/share/doc/fast-start/vllm.md.gz", "vLLM engines: the fill, the loader's options, kept compile "
     "artifacts, the hot standby, quantization and parallel layouts"),
]
EXIT = [("0", "success"),
        ("1", "what was asked for does not hold: a model not cached, a mismatch, a failed fill, an I/O error"),
        ("2", "a usage or configuration error"),
        ("3", "no daemon answers, or its socket is not trusted")]
SEE_ALSO = "systemctl(1), journalctl(1), systemd.service(5), systemd-sysusers(8)"


def esc(text: str) -> str:
    """Plain text as roff: backslashes and hyphens escaped, no line starting with a control character."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join(("\\&" + line) if line[:1] in (".", "'") else line for line in text.splitlines())


def paragraphs(text: str) -> list[str]:
    out = []
    for block in text.strip().split("\n\n"):
        out += [".PP", esc(" ".join(block.split()))]
    return out


def options(command: click.Command, ctx: click.Context) -> list[str]:
    out = []
    for param in command.get_params(ctx):
        record = param.get_help_record(ctx)
        if record is None:
            continue
        names, help_text = record
        out += [".TP", f"\\fB{esc(names)}\\fR", esc(" ".join(help_text.split())) or "\\&"]
    return out


def page() -> str:
    group = typer.main.get_command(app)
    ctx = click.Context(group, info_name="fast-start", **group.context_settings)     # -h as well as --help
    # SOURCE_DATE_EPOCH: a reproducible build's date (dpkg-buildpackage sets it from the changelog)
    date = time.strftime("%Y-%m-%d", time.gmtime(int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))))
    lines = [f'.TH FAST\\-START 8 "{date}" "fast-start {__version__}" "System Administration"',
             ".SH NAME", f"fast\\-start \\- {esc(NAME)}",
             ".SH SYNOPSIS", ".B fast\\-start", "[\\fB\\-\\-json\\fR] \\fICOMMAND\\fR [\\fIOPTIONS\\fR]",
             ".SH DESCRIPTION", *paragraphs(DESCRIPTION),
             ".SH OPTIONS", *options(group, ctx), ".SH COMMANDS"]
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        sub = click.Context(command, info_name=name, parent=ctx, **command.context_settings)
        usage = " ".join(command.collect_usage_pieces(sub))
        lines += [f".SS {esc(name)}", f".B fast\\-start {esc(name)}", esc(usage),
                  *paragraphs(command.help or command.short_help or ""), *options(command, sub)]
    lines += [".SH FILES"]
    for path, what in FILES:
        lines += [".TP", f"\\fI{esc(path)}\\fR", esc(what)]
    lines += [".SH EXIT STATUS"]
    for code, what in EXIT:
        lines += [".TP", f"\\fB{code}\\fR", esc(what)]
    lines += [".SH SEE ALSO", esc(SEE_ALSO)]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(page())
