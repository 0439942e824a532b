# 2026-11-28 (seventh session): the device calls on 2 x H200 (carry: .whl-dpo, .whl-peers/kohya), through
# bench/device_queue.sh, whose jobs are bench/device_jobs.sh's functions. Call 1 ran job_fsdp and the first 1- and
# 2-GPU runs of job_sdxl_repeat; the machine went back between calls (the queue with it), so call 2 started again:
JOBS="fsdp sdxl_repeat pair" WAIT=540 bash bench/device_queue.sh      # call 1: fsdp, sdxl-rep-1-1, sdxl-rep-2-1
JOBS="pair sdxl_repeat" WAIT=560 bash bench/device_queue.sh           # call 2, a fresh machine
WAIT=500 bash bench/device_queue.sh                                   # call 3: pair done; the budget ended here
# what the jobs ran:
python3 bench/scaling.py --gpus 2 --skip-llm --skip-sdxl --skip-wan --fsdp --fsdp-whole-state --fsdp-gathered --timeout 300
python3 bench/scaling.py --skip-llm --skip-wan --stacks toolkit --timeout 300 --sdxl-warmup 5 --sdxl-steps 60 --gpus 1 --counts 1   # GPU 0
python3 bench/scaling.py --skip-llm --skip-wan --stacks toolkit --timeout 300 --sdxl-warmup 5 --sdxl-steps 60 --gpus 2 --counts 2
# side by side, one GPU each (job_pair):
python3 bench/loss_parity.py --kinds sd15 --peers kohya --seeds 0,1,2 --steps 400 --timeout 300          # GPU 0
python3 bench/diffusion.py --models ltx2 --rows plain-ckpt,toolkit-auto,toolkit-swap24 --steps 4 --warmup 2 --timeout 400   # GPU 1
python3 bench/diffusion.py --models hunyuan15 --rows toolkit-swap24,toolkit-ckpt --steps 5 --warmup 3 --timeout 400          # GPU 1, after
