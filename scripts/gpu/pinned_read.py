"""Diagnostic: warm page-cache reads into pageable vs page-locked destinations."""

import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

UNIT = 36 << 20
N = 32
D = "/root/pr"
os.makedirs(D, exist_ok=True)
paths = [f"{D}/u{i}" for i in range(N)]
for p in paths:
    if not os.path.exists(p):
        with open(p, "wb") as f:
            f.write(os.urandom(UNIT))
fds = [os.open(p, os.O_RDONLY) for p in paths]
for fd in fds:
    os.pread(fd, UNIT, 0)


def run(buf: torch.Tensor, threads: int, piece: int) -> float:
    mv = memoryview(buf.numpy())

    def one(i: int) -> None:
        base = i * UNIT
        for off in range(0, UNIT, piece):
            os.preadv(fds[i], [mv[base + off : base + off + piece]], off)

    best = 0.0
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(5):
            t = time.perf_counter()
            list(pool.map(one, range(N)))
            best = max(best, N * UNIT / (time.perf_counter() - t) / 1e9)
    return best


pageable = torch.empty(N * UNIT, dtype=torch.uint8)
pageable.fill_(1)
alloc = torch.empty(N * UNIT, dtype=torch.uint8, pin_memory=True)
alloc.fill_(1)
for threads in (4, 8, 12):
    for piece in (UNIT, 256 << 10):
        a = run(pageable, threads, piece)
        r = torch.cuda.cudart().cudaHostRegister(pageable.data_ptr(), N * UNIT, 0)
        b = run(pageable, threads, piece)
        torch.cuda.cudart().cudaHostUnregister(pageable.data_ptr())
        c = run(alloc, threads, piece)
        print(
            f"threads {threads:2d} piece {piece >> 10:6d} KiB: pageable {a:5.1f} GB/s, "
            f"registered {b:5.1f} (rc {r}), cudaHostAlloc {c:5.1f}",
            flush=True,
        )
