"""`python -m bench.vmm_access`: what a fresh process's map of a VMM arena costs, step by step.

`cuMemSetAccess` is the one step of an engine's map whose time grows with the arena (`cudadrv`).
This asks whether an arena could be laid out so that it grows less: the reservation aligned to
2 MiB, 512 MiB or 1 GiB (larger GPU pages, if the driver took them), sizes that are or are not
multiples of 512 MiB, and one range made of eight 4 GiB allocations with the access set in one
call ("one"), one call per allocation ("seq") or one thread per allocation ("par").

The parent creates the allocations (ctypes, its own primary context) and exports them as fds;
each case runs in a fresh interpreter (three rounds) that initialises CUDA through torch, then
imports, reserves, maps and sets the access four times over: "first" is a fresh process's first
map, "later" the three after it. Microseconds, medians; with $OUT set, the raw samples go to
$OUT/probe_access.json.
"""
import ctypes, json, os, statistics, subprocess, sys, time

GIB, MIB = 1 << 30, 1 << 20

CHILD = r'''
import ctypes, json, sys, threading, time
import torch
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
lib = ctypes.CDLL("libcuda.so.1")
u64, sz = ctypes.c_uint64, ctypes.c_size_t
class Acc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int), ("flags", ctypes.c_int)]
lib.cuMemImportFromShareableHandle.argtypes = [ctypes.POINTER(u64), ctypes.c_void_p, ctypes.c_int]
lib.cuMemAddressReserve.argtypes = [ctypes.POINTER(u64), sz, sz, u64, u64]
lib.cuMemMap.argtypes = [u64, sz, sz, u64, u64]
lib.cuMemSetAccess.argtypes = [u64, sz, ctypes.POINTER(Acc), sz]
lib.cuMemUnmap.argtypes = [u64, sz]
lib.cuMemAddressFree.argtypes = [u64, sz]
def ck(c, w):
    if c: raise RuntimeError(f"{w}: {c}")
case = json.loads(sys.argv[1])
fds, sizes, align, mode, flags = case["fds"], case["sizes"], case["align"], case["mode"], case.get("flags", 1)
handles = []
for fd in fds:
    h = u64(); ck(lib.cuMemImportFromShareableHandle(ctypes.byref(h), ctypes.c_void_p(fd), 1), "import")
    handles.append(h.value)
total = sum(sizes)
out = []
for rep in range(4):
    t = {}
    t0 = time.perf_counter()
    p = u64(); ck(lib.cuMemAddressReserve(ctypes.byref(p), total, align, 0, 0), "reserve")
    t1 = time.perf_counter()
    off = 0
    for h, s in zip(handles, sizes):
        ck(lib.cuMemMap(p.value + off, s, 0, h, 0), "map"); off += s
    t2 = time.perf_counter()
    acc = Acc(1, 0, flags)
    if mode == "one":
        ck(lib.cuMemSetAccess(p.value, total, ctypes.byref(acc), 1), "access")
    elif mode == "seq":
        off = 0
        for s in sizes:
            ck(lib.cuMemSetAccess(p.value + off, s, ctypes.byref(acc), 1), "access"); off += s
    elif mode == "par":
        ths, off = [], 0
        for s in sizes:
            a = p.value + off
            ths.append(threading.Thread(target=lambda a=a, s=s: ck(lib.cuMemSetAccess(a, s, ctypes.byref(Acc(1, 0, flags)), 1), "access")))
            off += s
        for th in ths: th.start()
        for th in ths: th.join()
    t3 = time.perf_counter()
    x = torch.as_tensor(type("A", (), {"__cuda_array_interface__": {"shape": (total,), "typestr": "|u1", "data": (p.value, False), "version": 3}})(), device="cuda:0")
    s = x[::1 << 21].sum().item()   # one byte per 2 MiB
    t4 = time.perf_counter()
    del x
    torch.cuda.synchronize()
    off = 0
    for sz_ in sizes:
        ck(lib.cuMemUnmap(p.value + off, sz_), "unmap"); off += sz_
    ck(lib.cuMemAddressFree(p.value, total), "free")
    out.append({"reserve_us": (t1 - t0) * 1e6, "map_us": (t2 - t1) * 1e6, "access_us": (t3 - t2) * 1e6,
                "touch_us": (t4 - t3) * 1e6, "ptr_align_mib": (p.value & -p.value) >> 20})
print(json.dumps(out))
'''


def main():
    lib = ctypes.CDLL("libcuda.so.1")
    assert lib.cuInit(0) == 0
    dev = ctypes.c_int(); assert lib.cuDeviceGet(ctypes.byref(dev), 0) == 0
    ctx = ctypes.c_void_p(); assert lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) == 0
    assert lib.cuCtxSetCurrent(ctx) == 0

    class Loc(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]

    class Flags(ctypes.Structure):
        _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                    ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]

    class Prop(ctypes.Structure):
        _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", Loc),
                    ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", Flags)]
    prop = Prop(1, 1, Loc(1, 0), None, Flags(0, 0, 0))
    gmin, grec = ctypes.c_size_t(), ctypes.c_size_t()
    lib.cuMemGetAllocationGranularity(ctypes.byref(gmin), ctypes.byref(prop), 0)
    lib.cuMemGetAllocationGranularity(ctypes.byref(grec), ctypes.byref(prop), 1)
    print(f"granularity min {gmin.value >> 10} KiB, recommended {grec.value >> 10} KiB", flush=True)
    lib.cuMemCreate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(Prop), ctypes.c_uint64]
    lib.cuMemExportToShareableHandle.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64]

    def alloc(size):
        h = ctypes.c_uint64()
        t0 = time.perf_counter()
        rc = lib.cuMemCreate(ctypes.byref(h), size, ctypes.byref(prop), 0)
        assert rc == 0, rc
        fd = ctypes.c_int()
        assert lib.cuMemExportToShareableHandle(ctypes.byref(fd), h, 1, 0) == 0
        print(f"  alloc {size / GIB:.3f} GiB {(time.perf_counter() - t0) * 1e3:.2f} ms", flush=True)
        return fd.value

    a4 = alloc(4 * GIB)
    a4o = alloc(4 * GIB + 290 * MIB)        # like the real 4.45 GB arena
    a32 = alloc(32 * GIB)
    a32o = alloc(32 * GIB + 2 * MIB)
    chunks = [alloc(4 * GIB) for _ in range(8)]
    cases = {
        "4G a0": ([a4], [4 * GIB], 0, "one"),
        "4G a512M": ([a4], [4 * GIB], 512 * MIB, "one"),
        "4.28G a0": ([a4o], [4 * GIB + 290 * MIB], 0, "one"),
        "32G a0": ([a32], [32 * GIB], 0, "one"),
        "32G a2M": ([a32], [32 * GIB], 2 * MIB, "one"),
        "32G a512M": ([a32], [32 * GIB], 512 * MIB, "one"),
        "32G a1G": ([a32], [32 * GIB], GIB, "one"),
        "32G+2M a512M": ([a32o], [32 * GIB + 2 * MIB], 512 * MIB, "one"),
        "8x4G one": (chunks, [4 * GIB] * 8, 0, "one"),
        "8x4G seq": (chunks, [4 * GIB] * 8, 0, "seq"),
        "8x4G par": (chunks, [4 * GIB] * 8, 0, "par"),
        "2x4G par": (chunks[:2], [4 * GIB] * 2, 0, "par"),
        "32G a0 rw": ([a32], [32 * GIB], 0, "one", 3),
    }
    results = {}
    for rnd in range(3):
        for name, c in cases.items():
            fds, sizes, align, mode = c[:4]
            flags = c[4] if len(c) > 4 else 1
            arg = json.dumps({"fds": fds, "sizes": sizes, "align": align, "mode": mode, "flags": flags})
            done = subprocess.run([sys.executable, "-c", CHILD, arg], pass_fds=fds, capture_output=True, text=True)
            if done.returncode:
                print(name, "FAILED", done.stderr[-500:], flush=True)
                continue
            results.setdefault(name, []).extend([(rnd, i, r) for i, r in enumerate(json.loads(done.stdout.splitlines()[-1]))])
    for name, rs in results.items():
        first = [r for _, i, r in rs if i == 0]
        later = [r for _, i, r in rs if i > 0]
        med = lambda xs, k: statistics.median(x[k] for x in xs)
        print(f"{name:14} first: reserve {med(first, 'reserve_us'):7.1f} map {med(first, 'map_us'):7.1f} "
              f"access {med(first, 'access_us'):7.1f} touch {med(first, 'touch_us'):8.1f} | later: map "
              f"{med(later, 'map_us'):7.1f} access {med(later, 'access_us'):7.1f} | align {[r['ptr_align_mib'] for r in first]} MiB",
              flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "probe_access.json"), "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
