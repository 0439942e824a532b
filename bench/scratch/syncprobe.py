import torch, traceback
d = "cuda"
cases = {
 "foreach_add int64 0-dim + int": lambda: torch._foreach_add_([torch.zeros((), dtype=torch.int64, device=d) for _ in range(3)], 1),
 "foreach_add f32 0-dim + int": lambda: torch._foreach_add_([torch.zeros((), device=d) for _ in range(3)], 1),
 "foreach_add int64 0-dim + cuda tensor": lambda: torch._foreach_add_([torch.zeros((), dtype=torch.int64, device=d) for _ in range(3)], torch.ones((), dtype=torch.int64, device=d)),
 "foreach_add int64 0-dim + list of cuda tensors": lambda: torch._foreach_add_([torch.zeros((), dtype=torch.int64, device=d) for _ in range(3)], [torch.ones((), dtype=torch.int64, device=d)] * 3),
 "foreach_add f32 0-dim + cuda tensor": lambda: torch._foreach_add_([torch.zeros((), device=d) for _ in range(3)], torch.ones((), device=d)),
 "foreach_add int64 [1] + int": lambda: torch._foreach_add_([torch.zeros(1, dtype=torch.int64, device=d) for _ in range(3)], 1),
 "loop add_ int64 0-dim": lambda: [t.add_(1) for t in [torch.zeros((), dtype=torch.int64, device=d) for _ in range(3)]],
 "stack int64 0-dim": lambda: torch.stack([torch.zeros((), dtype=torch.int64, device=d) for _ in range(3)]),
}
for name, fn in cases.items():
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(); print("ok   ", name)
    except RuntimeError as e:
        print("SYNC ", name, "|", traceback.format_exc().strip().splitlines()[-3][:200])
    finally:
        torch.cuda.set_sync_debug_mode("default")
