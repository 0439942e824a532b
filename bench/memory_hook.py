"""The sitecustomize hook the benches put on PYTHONPATH for the processes they measure (the toolkit's, the
launcher's workers, which inherit the environment, and the peer trainers'): at exit, each process writes its peak
memory (GPU max_memory_allocated, or its max RSS without a GPU) as memory-PID.json into $SCALING_BENCH_MEMORY. The
measured programs themselves are not changed. Used by bench/scaling.py and bench/peers/common.py."""

MEMORY_HOOK = '''
import atexit, json, os, sys


def _scaling_bench_memory():
    folder = os.environ.get("SCALING_BENCH_MEMORY")
    if not folder:
        return
    record = {"rank": os.environ.get("RANK"), "pid": os.getpid()}
    try:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            device = torch.cuda.current_device()
            record.update(kind="gpu_max_allocated", device=device,
                          gib=torch.cuda.max_memory_allocated(device) / 2**30)
        else:
            import resource
            record.update(kind="process_max_rss", gib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    except Exception as err:
        record["error"] = repr(err)
    with open(os.path.join(folder, f"memory-{os.getpid()}.json"), "w") as handle:
        json.dump(record, handle)


atexit.register(_scaling_bench_memory)
'''
