"""What copying a served result's logits costs a step on a GPU: a clone of [bs x 4, vocab], GPU time
by CUDA events, median of 30, float32 and bfloat16 at bs 8 / 64 / 256.

    python3 bench/logits_clone.py
"""

import statistics

import torch

VOCAB = 129280  # DeepSeek-V3/V4's vocabulary


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        for bs in (8, 64, 256):
            src = torch.randn(bs * 4, VOCAB, device="cuda", dtype=dtype)
            for _ in range(5):
                src.clone()
            torch.cuda.synchronize()
            times = []
            for _ in range(30):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                src.clone()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) * 1000)
            mib = src.numel() * src.element_size() / 2**20
            print(f"{str(dtype):<15} bs {bs:>3}: {mib:8.1f} MiB, clone {statistics.median(times):7.1f} us GPU (median of 30)")


if __name__ == "__main__":
    main()
