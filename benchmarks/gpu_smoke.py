"""GPU smoke test: can this platform do CUDA IPC between two processes, and pin host memory?

Run first on a GPU machine (benchmarks/gpu_check.sh does), in about 10 seconds:

1. CUDA IPC: a child process (multiprocessing "spawn", a daemon) cudaMallocs 64 MiB on
   cuda:0, fills it with known bytes, records an interprocess event after the fill, and
   exports both handles (cudaIpcGetMemHandle, cudaIpcGetEventHandle); this process opens
   the event as the server opens a worker's store event (torch.cuda.Event.from_ipc_handle),
   makes a stream wait on it, opens the memory (cudaIpcOpenMemHandle,
   cudaIpcMemLazyEnablePeerAccess), reads the child's bytes and compares them, writes other
   bytes back, and the child compares those. This is what the server does with every
   worker's KV cache and STORE.
2. Pinning: 1 GiB of page-aligned host memory is pinned with cudaHostRegister (what the
   server does to its CPU pool), copied from the GPU into it and back, compared on the GPU,
   and unpinned.

Each step prints one line, "ok" with its time or "FAILED: reason", then a verdict.

    PYTHONPATH=. python3 benchmarks/gpu_smoke.py

Exit status: 0 all passed; 1 the smoke test itself broke; 2 no CUDA (or no cupy) here,
nothing checked; 3 the IPC handle did not open: the GPU path cannot run here; 4
cudaHostRegister was refused: the server would run with an unpinned pool (correct,
slower); 5 a pinned copy returned wrong bytes; 6 the child process did not start
(spawn); 7 the child started but its CUDA did not (or not within 30 s); 8 the
interprocess event did not open or complete. 3, 6, 7 and 8 say which part failed: only 3
and 8 mean CUDA IPC itself is refused here.
"""

from __future__ import annotations

import ctypes
import importlib
import mmap
import multiprocessing
import random
import sys
import time
import traceback

IPC_BYTES = 64 * 2**20
PIN_BYTES = 2**30
CHILD_TIMEOUT = 30.0  # seconds for any one answer of the child (its CUDA start included)
SEED_CHILD, SEED_PARENT = 1234, 5678

OK, BROKEN, NO_CUDA, NO_IPC, NO_PIN, WRONG_BYTES = 0, 1, 2, 3, 4, 5
NO_SPAWN, NO_CHILD_CUDA, NO_IPC_EVENT = 6, 7, 8
VERDICTS = {
    OK: "this platform does CUDA IPC between processes and pins host memory: "
        "the GPU path can run here",
    BROKEN: "the smoke test itself broke (see above): nothing proven either way",
    NO_IPC: "this platform refuses to open a CUDA IPC memory handle: the GPU path cannot "
            "run here",
    NO_SPAWN: "the child process did not start (spawn): CUDA IPC was not tried",
    NO_CHILD_CUDA: "the child process started but its CUDA did not: CUDA IPC was not tried",
    NO_IPC_EVENT: "this platform refuses CUDA IPC events: STOREs from GPU workers cannot "
                  "run here",
    NO_PIN: "this platform refuses cudaHostRegister: the server would run with an unpinned "
            "pool (correct, slower), and its bandwidth would not be representative",
    WRONG_BYTES: "copies through pinned host memory returned wrong bytes: "
                 "the GPU path would corrupt data here",
}


class StepFailed(Exception):
    """A step failed; `status`: the exit status that says which part."""

    def __init__(self, name: str, status: int = NO_IPC):
        super().__init__(name)
        self.status = status


def step(name: str, action, status: int = NO_IPC):
    """Run `action()`, print one line with its time; re-raise as StepFailed(status)."""
    start = time.perf_counter()
    try:
        result = action()
    except Exception as error:  # noqa: BLE001 - any failure is the step's verdict
        elapsed = time.perf_counter() - start
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"smoke: {name:<48} FAILED: {type(error).__name__}: {reason} ({elapsed:.2f} s)")
        raise StepFailed(name, status) from error
    print(f"smoke: {name:<48} ok ({time.perf_counter() - start:.2f} s)")
    return result


def host_pointer(buffer: bytearray) -> int:
    return ctypes.addressof((ctypes.c_char * len(buffer)).from_buffer(buffer))


def copy_to_device(pointer: int, data: bytes) -> None:
    import cupy
    source = bytearray(data)
    cupy.cuda.runtime.memcpy(pointer, host_pointer(source), len(source),
                             cupy.cuda.runtime.memcpyHostToDevice)


def copy_from_device(pointer: int, size: int) -> bytearray:
    import cupy
    target = bytearray(size)
    cupy.cuda.runtime.memcpy(host_pointer(target), pointer, size,
                             cupy.cuda.runtime.memcpyDeviceToHost)
    return target


def child_main(pipe) -> None:
    """The exporting process: allocate, fill, export; compare what the parent wrote back."""
    pointer = None
    try:
        import cupy
        cupy.cuda.Device(0).use()
        pointer = cupy.cuda.runtime.malloc(IPC_BYTES)  # cudaMalloc: the allocation's base
        copy_to_device(pointer, random.Random(SEED_CHILD).randbytes(IPC_BYTES))
        # As a worker's StoreEvent: interprocess, recorded after the writes it orders.
        event = cupy.cuda.Event(block=False, disable_timing=True, interprocess=True)
        event.record()
        cupy.cuda.runtime.deviceSynchronize()
        pipe.send(("handle", bytes(cupy.cuda.runtime.ipcGetMemHandle(pointer)),
                   bytes(cupy.cuda.runtime.ipcGetEventHandle(event.ptr))))
        if not pipe.poll(CHILD_TIMEOUT):
            return
        if pipe.recv() != "check":
            return
        ok = bytes(copy_from_device(pointer, IPC_BYTES)) == random.Random(
            SEED_PARENT).randbytes(IPC_BYTES)
        pipe.send(("checked", ok))
        pipe.poll(CHILD_TIMEOUT)  # "closed": free only once the parent has closed its handle
    except Exception as error:  # noqa: BLE001 - reported to the parent, which decides
        pipe.send(("error", f"{type(error).__name__}: {error}".splitlines()[0]))
    finally:
        if pointer is not None:
            try:
                import cupy
                cupy.cuda.runtime.free(pointer)
            except Exception:  # noqa: BLE001 - the process is ending anyway
                pass


def receive(pipe, child, what: str):
    """The child's next message, or an error naming what was awaited."""
    deadline = time.monotonic() + CHILD_TIMEOUT
    while not pipe.poll(0.1):
        if not child.is_alive():
            raise RuntimeError(f"the child exited with {child.exitcode} before {what}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} from the child within {CHILD_TIMEOUT:.0f} s")
    message = pipe.recv()
    if message[0] == "error":
        raise RuntimeError(f"in the child: {message[1]}")
    return message


def check_ipc() -> None:
    """Step 1: a handle exported by a spawned child, opened, read and written here."""
    import cupy
    import torch
    context = multiprocessing.get_context("spawn")
    mine, theirs = context.Pipe()
    child = context.Process(target=child_main, args=(theirs,), name="gpu-smoke-child",
                            daemon=True)
    opened = None
    try:
        step("start a child process (spawn)", child.start, NO_SPAWN)
        _, handle, event_handle = step("child: cudaMalloc 64 MiB, fill, export handles",
                                       lambda: receive(mine, child, "its IPC handles"),
                                       NO_CHILD_CUDA)

        def wait_for_event():
            event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), event_handle)
            stream = torch.cuda.Stream()
            stream.wait_event(event)
            stream.synchronize()
            if not event.query():
                raise RuntimeError("the opened event never completed")
        step("open the event (from_ipc_handle), wait on it", wait_for_event, NO_IPC_EVENT)
        opened = step("open the handle (cudaIpcOpenMemHandle)",
                      lambda: cupy.cuda.runtime.ipcOpenMemHandle(
                          handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess))

        def read_and_compare():
            if bytes(copy_from_device(opened, IPC_BYTES)) != random.Random(
                    SEED_CHILD).randbytes(IPC_BYTES):
                raise ValueError("the bytes read through the handle differ from the child's")
        step("read the child's 64 MiB, compare", read_and_compare)

        def write_back():
            copy_to_device(opened, random.Random(SEED_PARENT).randbytes(IPC_BYTES))
            cupy.cuda.runtime.deviceSynchronize()
            mine.send("check")
            if not receive(mine, child, "its comparison")[1]:
                raise ValueError("the child read other bytes than this process wrote")
        step("write 64 MiB through the handle, child compares", write_back)
    finally:
        if opened is not None:
            try:
                cupy.cuda.runtime.ipcCloseMemHandle(opened)
            except Exception as error:  # noqa: BLE001
                print(f"smoke: closing the IPC handle failed: {error}")
        try:
            mine.send("closed")
        except OSError:
            pass  # the child has gone already
        child.join(CHILD_TIMEOUT if child.is_alive() else 0)
        if child.is_alive():
            child.kill()
            child.join(5)


def check_pinning() -> int:
    """Step 2: pin 1 GiB with cudaHostRegister, copy GPU -> host -> GPU, compare."""
    import torch
    cudart = torch.cuda.cudart()
    area = mmap.mmap(-1, PIN_BYTES)  # anonymous, page-aligned, like the server's pool
    host = torch.frombuffer(area, dtype=torch.uint8)
    registered = False
    try:
        def prefault():
            host.fill_(0)
        step("touch 1 GiB of host memory", prefault)

        def pin():
            torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), PIN_BYTES, 0))
        try:
            step("pin 1 GiB (cudaHostRegister)", pin)
        except StepFailed:
            return NO_PIN
        registered = True
        source = torch.randint(0, 256, (PIN_BYTES,), dtype=torch.uint8, device="cuda:0")
        back = torch.empty_like(source)
        torch.cuda.synchronize()

        def timed_copy(target, origin) -> str:
            start = time.perf_counter()
            target.copy_(origin, non_blocking=True)
            torch.cuda.synchronize()
            return f"{PIN_BYTES / (time.perf_counter() - start) / 1e9:.1f} GB/s"

        rates = []
        step("copy 1 GiB GPU -> pinned host", lambda: rates.append(timed_copy(host, source)))
        step("copy 1 GiB pinned host -> GPU", lambda: rates.append(timed_copy(back, host)))
        print(f"smoke: pinned copy rates: D2H {rates[0]}, H2D {rates[1]} (one copy each, "
              "cold: not a benchmark)")

        def compare():
            if not torch.equal(source, back):
                raise ValueError("the bytes back from pinned host memory differ")
        try:
            step("compare 1 GiB on the GPU", compare)
        except StepFailed:
            return WRONG_BYTES
        return OK
    finally:
        if registered:
            try:
                step("unpin (cudaHostUnregister)",
                     lambda: torch.cuda.check_error(cudart.cudaHostUnregister(host.data_ptr())))
            except StepFailed:
                pass
        # The mapping is left to the process's end: `host` still views it.


def cuda_here() -> str | None:
    """Why CUDA cannot be checked here, or None when torch sees a GPU and cupy imports."""
    try:
        import torch
    except ImportError as error:
        return f"torch is not importable ({error})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    try:
        importlib.import_module("cupy")
    except ImportError as error:
        return f"cupy is not importable ({error}): install cupy-cuda12x or cupy-cuda13x"
    return None


def main() -> int:
    started = time.perf_counter()
    why = cuda_here()
    if why is not None:
        print(f"gpu_smoke: no CUDA here, nothing checked: {why}", file=sys.stderr)
        return NO_CUDA
    import torch
    step("CUDA start (torch, cuda:0)", lambda: torch.zeros(1, device="cuda:0").item())
    print(f"smoke: device {torch.cuda.get_device_name(0)}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    status = OK
    try:
        check_ipc()
    except StepFailed as failed:
        status = failed.status
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        status = BROKEN
    try:
        pinned = check_pinning()
    except StepFailed:
        pinned = WRONG_BYTES  # a copy itself failed
    except Exception:  # noqa: BLE001
        traceback.print_exc()
        pinned = BROKEN
    if status == OK:
        status = pinned
    print(f"gpu_smoke: {'PASSED' if status == OK else 'FAILED'} in "
          f"{time.perf_counter() - started:.1f} s: {VERDICTS[status]}")
    return status


if __name__ == "__main__":
    sys.exit(main())
