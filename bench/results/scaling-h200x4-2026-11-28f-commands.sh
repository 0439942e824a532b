# bench/scaling.py on 4 x H200 (one host), 2026-11-28 (sixth session). Three device calls.
# Call 1 and 2: JOBS="scale4" WAIT=540 bash bench/device_queue.sh, then WAIT=400 bash bench/device_queue.sh
#   (bench/device_jobs.sh job_scale4: 1-GPU SDXL | 1-GPU Wan | 2-GPU fsdp side by side; then SDXL on 2 | Wan on 2
#   side by side; then SDXL on 4, Wan on 4, fsdp on 4 alone; then the gpu tests of tests/test_step_sync.py)
#   -> scaling-h200x4-{sdxl,wan}-{1,2,4}-2026-11-28f.*, scaling-h200x4-fsdp-{2,4}-2026-11-28f.*
# Call 3, the same machine, nothing else running (each run alone, warm compile cache):
export PYTHONPATH=/tmp/site:$PWD
S="python3 bench/scaling.py --skip-llm --stacks toolkit --timeout 200"
for n in 1 2; do d=0; [ $n = 2 ] && d=0,1
  CUDA_VISIBLE_DEVICES=$d $S --skip-wan --sdxl-warmup 5 --sdxl-steps 20 --work /tmp/w-sdxl --gpus $n --counts $n \
      --out $OUT/sdxl-alone-$n.json; done          # -> scaling-h200x4-sdxl-alone-{1,2}-2026-11-28f.json
for n in 1 2; do d=0; [ $n = 2 ] && d=0,1
  CUDA_VISIBLE_DEVICES=$d $S --skip-sdxl --work /tmp/w-wan --gpus $n --counts $n --out $OUT/wan-alone-$n.json; done
# Call 4, a fresh 2 x H200 machine, after the test fix: python3 -m pytest -q -m gpu tests/test_step_sync.py
#   -> gpu-tests-h200x2-2026-11-28f.txt (10 passed). Its SDXL 1-GPU repeats (60 timed steps) ran out of device time.
