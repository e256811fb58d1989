"""Which CUDA driver calls, made from another thread in the relaxed capture mode, invalidate a
graph that the main thread captures in the default (global) mode? One row per call: the call's
result and whether the capture survived. Runs on a GPU (the H200 device machine):
``python3 bench/probes/capture_probe.py``. Note [Graph capture beside the mapper]."""

from __future__ import annotations

import ctypes
import threading

import torch

cuda = ctypes.CDLL("libcuda.so.1")
MIB = 1 << 20


class Prop(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [
        ("type", ctypes.c_int),
        ("handleTypes", ctypes.c_int),
        ("loc_type", ctypes.c_int),
        ("loc_id", ctypes.c_int),
        ("win32", ctypes.c_void_p),
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class Access(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("loc_type", ctypes.c_int), ("loc_id", ctypes.c_int), ("flags", ctypes.c_int)]


def main() -> None:
    torch.cuda.init()
    x = torch.ones(1 << 16, device="cuda")
    torch.cuda.synchronize()
    ctx = ctypes.c_void_p()
    cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    prop = Prop(type=1, handleTypes=0, loc_type=1, loc_id=0)
    va = ctypes.c_ulonglong()
    assert (
        cuda.cuMemAddressReserve(
            ctypes.byref(va),
            ctypes.c_size_t(64 * MIB),
            ctypes.c_size_t(0),
            ctypes.c_ulonglong(0),
            ctypes.c_ulonglong(0),
        )
        == 0
    )
    access = Access(loc_type=1, loc_id=0, flags=3)
    state = {"handle": ctypes.c_ulonglong(), "mapped": False}

    def create():
        return cuda.cuMemCreate(
            ctypes.byref(state["handle"]),
            ctypes.c_size_t(2 * MIB),
            ctypes.byref(prop),
            ctypes.c_ulonglong(0),
        )

    def map_():
        return cuda.cuMemMap(
            va, ctypes.c_size_t(2 * MIB), ctypes.c_size_t(0), state["handle"], ctypes.c_ulonglong(0)
        )

    def set_access():
        return cuda.cuMemSetAccess(
            va, ctypes.c_size_t(2 * MIB), ctypes.byref(access), ctypes.c_size_t(1)
        )

    def unmap():
        return cuda.cuMemUnmap(va, ctypes.c_size_t(2 * MIB))

    def release():
        return cuda.cuMemRelease(state["handle"])

    def sync():
        return cuda.cuCtxSynchronize()

    calls = [
        ("cuMemCreate", create),
        ("cuMemMap", map_),
        ("cuMemSetAccess", set_access),
        ("cuMemUnmap", unmap),
        ("cuMemRelease", release),
        ("cuCtxSynchronize", sync),
    ]
    for relaxed in (True, False):
        for name, call in calls:
            # set up the state the call needs, outside any capture
            if name in ("cuMemMap",):
                create()
            if name in ("cuMemSetAccess", "cuMemUnmap"):
                create()
                map_()
            if name == "cuMemRelease":
                create()
            torch.cuda.synchronize()
            inside, done, result = threading.Event(), threading.Event(), [None]

            def other(
                relaxed: bool, inside: threading.Event, done: threading.Event, result: list, call
            ) -> None:
                cuda.cuCtxSetCurrent(ctx)
                mode = ctypes.c_int(2 if relaxed else 0)
                cuda.cuThreadExchangeStreamCaptureMode(ctypes.byref(mode))
                inside.wait(10)
                result[0] = call()
                done.set()

            t = threading.Thread(target=other, args=(relaxed, inside, done, result, call))
            t.start()
            graph = torch.cuda.CUDAGraph()
            survived = "yes"
            try:
                with torch.cuda.graph(graph):
                    y = x * 2
                    inside.set()
                    done.wait(10)
                    y = y * 2
                graph.replay()
                torch.cuda.synchronize()
            except Exception as error:  # the capture was invalidated
                survived = f"no: {str(error).splitlines()[0][:80]}"
                torch.cuda.synchronize()
            t.join(10)
            # tidy outside capture
            if name in ("cuMemMap", "cuMemSetAccess"):
                unmap()
                release()
            if name in ("cuMemCreate",):
                release()
            if name == "cuMemUnmap":
                if result[0] != 0:
                    unmap()
                release()
            print(
                f"| {'relaxed' if relaxed else 'global'} | {name} | {result[0]} | {survived} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
