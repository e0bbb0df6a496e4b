"""Pack, packed vote and unpack time, each as a ratio to a memcpy of the same fp32 buffer.

The per-rank pipeline of the vote collective is: pack the whole gradient (plus the zero
check), vote this rank's 1/M shard from M packed vectors, unpack the whole result. Target:
that pipeline within 3x one memcpy. Ratios are measured in one run, so a busy machine slows
numerator and denominator alike.

    python -m signmuon.benchmarks.kernels --sizes 1M 4M 16M 64M --world-size 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from signmuon.comm_hooks import pack_planes, pack_planes_checked, unpack_signs, vote_packed

_SUFFIX = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """'4M' -> 4194304; plain integers pass through."""
    text = text.strip().upper()
    if text and text[-1] in _SUFFIX:
        return int(float(text[:-1]) * _SUFFIX[text[-1]])
    return int(text)


def _median_time(fn, repeats: int, device: torch.device) -> float:
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(numel: int, world_size: int, device: torch.device, repeats: int = 5) -> dict[str, float]:
    """Seconds for memcpy, pack, shard vote and unpack of ``numel`` fp32 entries."""
    x = torch.randn(numel, device=device)
    copy_out = torch.empty_like(x)
    unpack_out = torch.empty_like(x)
    packed, _ = pack_planes(x)
    words = -(-numel // 64)
    shard = -(-words // world_size)
    gen = torch.Generator(device=device).manual_seed(0)
    planes = torch.randint(0, 256, (world_size, shard * 8), dtype=torch.uint8, device=device, generator=gen)
    planes = planes.view(torch.int64)  # [M, S]: the shard this rank votes
    result = {
        "memcpy": _median_time(lambda: copy_out.copy_(x), repeats, device),
        # What each rank does to its own gradient: both planes and the NaN/Inf check.
        "pack": _median_time(lambda: pack_planes_checked(x), repeats, device),
        "vote": _median_time(lambda: vote_packed(planes), repeats, device),
        "unpack": _median_time(lambda: unpack_signs(packed, numel, out=unpack_out), repeats, device),
    }
    result["pipeline"] = result["pack"] + result["vote"] + result["unpack"]
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["1M", "4M", "16M", "64M"], help="entries, e.g. 1M 64M")
    parser.add_argument("--world-size", type=int, default=4, help="M: the vote counts M packed shards")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 = one core)")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = []
    print(f"device={device} threads={args.threads} world_size={args.world_size} torch={torch.__version__}")
    print(f"{'entries':>10} {'memcpy ms':>10} {'pack/cp':>8} {'vote/cp':>8} {'unpack/cp':>9} {'pipeline/cp':>11}")
    for size in args.sizes:
        numel = parse_size(size)
        t = measure(numel, args.world_size, device, args.repeats)
        ratio = {k: v / t["memcpy"] for k, v in t.items()}
        rows.append({"numel": numel, **{f"{k}_s": v for k, v in t.items()}, **{f"{k}_ratio": v for k, v in ratio.items()}})
        print(
            f"{size:>10} {t['memcpy'] * 1e3:>10.2f} {ratio['pack']:>8.2f} {ratio['vote']:>8.2f} "
            f"{ratio['unpack']:>9.2f} {ratio['pipeline']:>11.2f}"
        )
    return rows


if __name__ == "__main__":
    main()
