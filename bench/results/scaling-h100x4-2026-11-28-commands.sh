# bench/scaling.py on 4 H100s (one host), 2026-11-28: the second call of the session (run as bash this.sh with OUT set).
# The first call: python bench/scaling.py --gpus 4 --counts 1,2,4 --skip-llm --skip-wan --stacks toolkit,plain --no-plain-compiled --sdxl-warmup 5 --sdxl-steps 30 --timeout 240 (stopped at 560 s, in the 4-GPU run).
#!/bin/bash
# phase 1: SDXL 1 GPU cold (GPU 0, warms the compile cache) | fsdp 2 GPUs then the 2-GPU tests (GPUs 2,3)
W=/tmp/w45; mkdir -p $W
S="python bench/scaling.py --skip-llm --skip-wan --stacks toolkit,plain --no-plain-compiled --sdxl-warmup 5 --sdxl-steps 30 --timeout 240 --work $W"
( CUDA_VISIBLE_DEVICES=0 $S --gpus 1 --counts 1 --stacks toolkit --out $OUT/sdxl-1-cold.json > $OUT/sdxl-1-cold.txt 2>&1 ) &
( CUDA_VISIBLE_DEVICES=2,3 python bench/scaling.py --gpus 2 --skip-llm --skip-sdxl --skip-wan --fsdp --timeout 200 --out $OUT/fsdp.json > $OUT/fsdp.txt 2>&1;
  CUDA_VISIBLE_DEVICES=2,3 MASTER_PORT=29611 timeout 200 python -m pytest -q -x -m gpu tests/test_step_sync.py -k two_processes -p no:cacheprovider > $OUT/gpu-tests.txt 2>&1 ) &
wait
echo "== phase 1 done at $SECONDS s"; grep -h "GPU(s)\|ratio\|fsdp /\|passed\|failed" $OUT/*.txt
# phase 2: SDXL on 4 GPUs (warm cache), toolkit and plain; phase 3: SDXL 1 GPU warm
$S --gpus 4 --counts 4 --out $OUT/sdxl-4.json 2>&1 | grep -v "Writing model" > $OUT/sdxl-4.txt
echo "== phase 2 done at $SECONDS s"; grep -h "GPU(s)" $OUT/sdxl-4.txt
CUDA_VISIBLE_DEVICES=0 $S --gpus 1 --counts 1 --stacks toolkit --out $OUT/sdxl-1-warm.json 2>&1 | grep -v "Writing model" > $OUT/sdxl-1-warm.txt
echo "== phase 3 done at $SECONDS s"; grep -h "GPU(s)" $OUT/sdxl-1-warm.txt
