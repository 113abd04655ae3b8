"""Report bodies: typed on both sides, checked once where they enter (`reports.read`)."""
import json

import pytest

from fast_start import reports
from fast_start.protocol import ProtocolError


def status(**changed) -> reports.Status:
    model = reports.CachedModel(name="m", rank=0, tensor_parallel_size=1, bytes=1 << 20, tensors=3,
                                fingerprint="0123456789abcdef", fill_seconds=0.5, filled_at=1.7e9, adopted=False,
                                arenas=1, path="/models/m")
    fields = dict(gpu=0, state="incomplete", pid=42, models=[model],
                  missing=[reports.Missing("n", "failed", "no room", 1.7e9), reports.Missing("o", "missing")],
                  leases=[reports.Lease(1, 43, 1000, "m", "zero_copy", 1.7e9)], device="cuda:0", version="0.2.0",
                  started_at=1.7e9, reloads=0, memory=reports.Memory(held=1 << 20, keep_free=0))
    return reports.Status(**{**fields, **changed})


def test_a_status_goes_over_json_and_comes_back_equal_leaving_out_what_is_none():
    s = status()
    wire = json.loads(json.dumps(reports.body(s)))
    assert reports.read(reports.Status, wire) == s
    assert "total" not in wire["memory"] and "note" not in wire["models"][0] and "since" not in wire["missing"][1]
    assert wire["models"][0]["path"] == "/models/m" and wire["leases"][0]["mode"] == "zero_copy"


@pytest.mark.parametrize("damage,named", [
    (lambda b: b.pop("pid"), "lacks 'pid'"),
    (lambda b: b.update(pid="42"), "'pid' is '42', not int"),
    (lambda b: b.update(pid=True), "'pid' is 'True', not int"),
    (lambda b: b["models"][0].update(bytes=1.5), "'models'[0]'s 'bytes' is '1.5', not int"),
    (lambda b: b["missing"][0].pop("state"), "'missing'[0] lacks 'state'"),
    (lambda b: b.update(leases={}), "'leases' is not a list"),
    (lambda b: b.update(memory=[1, 2]), "'memory' is a list, not an object"),
])
def test_a_damaged_report_is_refused_naming_the_field(damage, named):
    wire = reports.body(status())
    damage(wire)
    with pytest.raises(ProtocolError) as e:
        reports.read(reports.Status, wire, "GPU 0's status report")
    assert e.value.what.startswith("GPU 0's status report") and named in e.value.what, e.value.what
    assert e.value.fix


def test_an_older_daemons_status_reads_with_defaults_and_a_newer_ones_extra_keys_are_left_out():
    wire = reports.body(status())
    for key in ("reloads", "reload_error", "version", "started_at", "memory", "device"):
        del wire[key]
    old = reports.read(reports.Status, {**wire, "from_the_future": 1})
    assert old.reloads is None and old.memory is None and old.version == ""
    assert "from_the_future" not in reports.body(old)


def test_a_float_field_takes_an_integer_as_json_writes_it():
    s = reports.read(reports.Eviction, {"time": 1700000000, "model": "m", "reason": "manual", "bytes": 1, "leases": 0})
    assert s.time == 1700000000


def test_a_leases_role_and_gpu_memory_come_over_json_and_show_in_status():
    """A standby's lease as the daemon reports it (its process's GPU memory from NVML) and as
    `fast-start status` prints it; a lease whose memory the daemon cannot tell shows none."""
    from fast_start.cli import _lease
    standby = reports.Lease(2, 44, 1000, "m", "zero_copy", 1.7e9, role="standby", gpu_bytes=3 * 2**29)
    s = status(leases=[reports.Lease(1, 43, 1000, "m", "zero_copy", 1.7e9), standby])
    wire = json.loads(json.dumps(reports.body(s)))
    assert reports.read(reports.Status, wire) == s and "gpu_bytes" not in wire["leases"][0]
    assert [_lease(l) for l in s.leases] == ["43:zero_copy", "44:zero_copy:standby 1.50 GiB"]
