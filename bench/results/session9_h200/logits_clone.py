"""What copying the served result's logits costs a step: a clone of [bs x 4, vocab] on the GPU."""
import statistics, torch
VOCAB = 129280  # DeepSeek-V3/V4's vocabulary
for dtype in (torch.float32, torch.bfloat16):
    for bs in (8, 64, 256):
        src = torch.randn(bs * 4, VOCAB, device="cuda", dtype=dtype)
        for _ in range(5): src.clone()
        torch.cuda.synchronize()
        times = []
        for _ in range(30):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); c = src.clone(); b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000)
        print(f"{str(dtype):<15} bs {bs:>3}: {src.numel() * src.element_size() / 2**20:8.1f} MiB, clone {statistics.median(times):7.1f} us GPU (median of 30)")
