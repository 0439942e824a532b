# The jobs bench/device_queue.sh runs, one function each, in the order of what the open issues still need
# (bench/results/session-note-*.md says which). R is the results folder; each job writes R/NAME.txt and R/NAME.json.
# What each needs carried (device call `carry`): .whl-dpo always (bash bench/device_wheels.sh); the peer named (.whl-peers/kohya, musubi or
# aitk, about 23 MB each) and .whl-unsloth for the unsloth rows. Carry is limited to 64 MiB a call, so at most two
# peers with .whl-dpo.
D="python3 bench/diffusion.py"

# issue 39: loss parity with the bench's fixes (the peer's targets, a narrow VAE posterior); about 12 minutes each
job_parity_sd15() { python3 bench/loss_parity.py --kinds sd15 --peers kohya --seeds 0,1,2 --steps 400 --timeout 300 --out $R/parity_sd15.json > $R/parity_sd15.txt 2>&1; }   # kohya
job_parity_wan() { python3 bench/loss_parity.py --kinds wan --peers musubi --seeds 0,1,2 --steps 400 --timeout 300 --out $R/parity_wan.json > $R/parity_wan.txt 2>&1; }     # musubi
job_parity_flux() { python3 bench/loss_parity.py --kinds flux --peers kohya --seeds 0,1,2 --steps 400 --timeout 400 --out $R/parity_flux.json > $R/parity_flux.txt 2>&1; }  # kohya
# issue 39: speed beside the peers (memory-matched rows: -recompute)
job_sd15() { $D --models sd15 --rows toolkit-auto,toolkit-ckpt-recompute,kohya --steps 20 --warmup 10 --timeout 300 --out $R/sd15.json > $R/sd15.txt 2>&1; }   # kohya
job_sdxl() { $D --models sdxl --rows toolkit-auto,kohya --steps 10 --warmup 5 --timeout 300 --out $R/sdxl.json > $R/sdxl.txt 2>&1; }   # kohya
job_wan() { $D --models wan --rows toolkit-auto,toolkit-ckpt-recompute,musubi,aitk --steps 10 --warmup 5 --timeout 300 --out $R/wan.json > $R/wan.txt 2>&1; }   # musubi, aitk
job_wan22() { $D --models wan22 --rows toolkit-auto,toolkit-swap24,musubi,musubi-24g --steps 5 --warmup 3 --timeout 400 --out $R/wan22.json > $R/wan22.txt 2>&1; }   # musubi
job_flux() { $D --models flux --rows toolkit-auto,toolkit-cap25,kohya,kohya-24g,aitk,aitk-24g --steps 5 --warmup 3 --timeout 400 --out $R/flux.json > $R/flux.txt 2>&1; }   # kohya, aitk; ~60 GB of disk
job_qwen_image() { $D --models qwen_image --rows toolkit-auto,toolkit-swap24,musubi,musubi-24g,aitk,aitk-24g --steps 5 --warmup 3 --timeout 400 --out $R/qwen_image.json > $R/qwen_image.txt 2>&1; }   # musubi, aitk
# issue 40: the new families' low-memory rows and compile evidence, LTX-2 (writes 38 GB)
job_hunyuan15() { $D --models hunyuan15 --rows toolkit-swap24,toolkit-ckpt --steps 5 --warmup 3 --timeout 400 --out $R/hunyuan15.json > $R/hunyuan15.txt 2>&1; }
# issue 40 part 2: train.compile=auto's evidence for HunyuanVideo 1.5 and Chroma (each compiled row beside its eager
# twin in one run; on 2026-11-28 HunyuanVideo's compiled rows and its eager auto row came from different runs)
job_compile_evidence() {
    $D --models hunyuan15 --rows toolkit-ckpt-eager,toolkit-ckpt --steps 5 --warmup 3 --timeout 400 --out $R/hunyuan15-compile.json > $R/hunyuan15-compile.txt 2>&1
    $D --models chroma --rows toolkit-eager,toolkit-auto --steps 8 --warmup 4 --timeout 400 --out $R/chroma-compile.json > $R/chroma-compile.txt 2>&1
}
# issue 40: the edit families on the GPU (FLUX.1 Kontext, Qwen-Image-Edit-2509; one reference per target), with
# their compile evidence; Qwen-Image-Edit writes ~41 GB
# issue 38 part 2: a warm SDXL run's start-up, phase by phase (the cold run fills the cache; profile: a warm run
# under cProfile); about 6 minutes
job_startup() { python3 bench/compile_times.py --jobs sdxl:blocks --phases cold,warm,profile --work /tmp/w-startup --timeout 400 --out $R/startup.json > $R/startup.txt 2>&1; cp /tmp/w-startup/sdxl-blocks/startup-profile.txt /tmp/w-startup/sdxl-blocks/startup-profile.prof $R/ 2>/dev/null; }
# FLUX.1 Kontext compiled (none checkpointed) beside 2026-11-29's eager toolkit-auto row: train.compile=auto's evidence
# issue 38 part 2: cold and warm compile times of the DiT families (SD1.5, SDXL and the LLM are measured), each a
# cold run then a warm one with its own cache folder; about 25 minutes, the large ones write 17-41 GB each
job_compile_families() { python3 bench/compile_times.py --jobs flux:blocks,chroma:blocks,wan:blocks,hunyuan15:blocks,flux_kontext:blocks,ltx2:blocks,qwen_image:blocks --work /tmp/w-compile --timeout 600 --out $R/compile-families.json > $R/compile-families.txt 2>&1; }
job_kontext_compiled() { $D --models flux_kontext --rows toolkit,toolkit-eager --steps 5 --warmup 3 --timeout 400 --out $R/kontext-compiled.json > $R/kontext-compiled.txt 2>&1; }
job_kontext3() { $D --models flux_kontext --rows plain,toolkit-auto,toolkit-swap24 --steps 5 --warmup 3 --timeout 400 --out $R/kontext.json > $R/kontext.txt 2>&1; }
job_kontext() { $D --models flux_kontext --rows plain,plain-compiled,toolkit-eager,toolkit-auto,toolkit-swap24 --steps 5 --warmup 3 --timeout 400 --out $R/kontext.json > $R/kontext.txt 2>&1; }
job_qwen_edit() { $D --models qwen_image_edit --rows plain-ckpt,toolkit-eager,toolkit-auto,toolkit-swap24 --steps 5 --warmup 3 --timeout 400 --out $R/qwen_edit.json > $R/qwen_edit.txt 2>&1; }
job_ltx2() { $D --models ltx2 --rows plain-ckpt,toolkit-auto,toolkit-swap24 --steps 4 --warmup 2 --timeout 400 --out $R/ltx2.json > $R/ltx2.txt 2>&1; }
# issue 43: GRPO's checkpointed rows beside unsloth in one command
job_grpo() { python3 bench/llm_objectives.py --objective grpo --steps 5 --warmup 2 --timeout 200 --out $R/grpo.json > $R/grpo.txt 2>&1; }   # unsloth
# issues 38 and 45: several GPUs (a kind with 2 or 4 GPUs)
job_fsdp() { python3 bench/scaling.py --gpus 2 --skip-llm --skip-sdxl --skip-wan --fsdp --fsdp-whole-state --fsdp-gathered --timeout 300 --out $R/fsdp.json > $R/fsdp.txt 2>&1; }
# issue 45 on a 4-GPU machine, about 20 minutes: what the 4 x H100 runs of 2026-11-28 left (Wan 1/2/4, SDXL with the
# CUDA-event timing, fsdp on 4) and 38's fsdp rows on 2. Runs that share no GPU run side by side (the 1-GPU runs
# beside the 2-GPU fsdp rows; SDXL on 2 beside Wan on 2); the 4-GPU runs alone. Each workload keeps one --work
# folder, so its later phases reuse its model, latents and compile cache.
job_scale4() {
    local S="python3 bench/scaling.py --skip-llm --stacks toolkit,plain --no-plain-compiled --timeout 300"
    local SX="$S --skip-wan --sdxl-warmup 5 --sdxl-steps 20 --work /tmp/w-sdxl" WN="$S --skip-sdxl --work /tmp/w-wan"
    ( CUDA_VISIBLE_DEVICES=0 $SX --gpus 1 --counts 1 --out $R/sdxl-1.json > $R/sdxl-1.txt 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=1 $WN --gpus 1 --counts 1 --out $R/wan-1.json > $R/wan-1.txt 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=2,3 python3 bench/scaling.py --gpus 2 --skip-llm --skip-sdxl --skip-wan --fsdp \
        --fsdp-whole-state --fsdp-offload --timeout 300 --out $R/fsdp-2.json > $R/fsdp-2.txt 2>&1 ) &
    wait; echo "$(date +%T) phase 1 done" >> $R/queue.log
    ( CUDA_VISIBLE_DEVICES=0,1 $SX --gpus 2 --counts 2 --out $R/sdxl-2.json > $R/sdxl-2.txt 2>&1 ) &
    ( CUDA_VISIBLE_DEVICES=2,3 $WN --gpus 2 --counts 2 --out $R/wan-2.json > $R/wan-2.txt 2>&1 ) &
    wait; echo "$(date +%T) phase 2 done" >> $R/queue.log
    $SX --gpus 4 --counts 4 --out $R/sdxl-4.json > $R/sdxl-4.txt 2>&1
    echo "$(date +%T) sdxl-4 done" >> $R/queue.log
    $WN --gpus 4 --counts 4 --out $R/wan-4.json > $R/wan-4.txt 2>&1
    echo "$(date +%T) wan-4 done" >> $R/queue.log
    python3 bench/scaling.py --gpus 4 --counts 4 --skip-llm --skip-sdxl --skip-wan --fsdp --timeout 300 \
        --out $R/fsdp-4.json > $R/fsdp-4.txt 2>&1
    echo "$(date +%T) fsdp-4 done" >> $R/queue.log
    CUDA_VISIBLE_DEVICES=0,1 timeout 200 python3 -m pytest -q -m gpu tests/test_step_sync.py -p no:cacheprovider \
        > $R/gpu-tests.txt 2>&1
}
# issue 45: SDXL's step time ran 142 to 203 ms between runs of one shape (2026-11-28f), so one 1-GPU and one 2-GPU run
# cannot give its scaling. Alternate 1- and 2-GPU runs, three each, 60 timed steps, the step time of every logged
# interval kept (step_ms_by_record): the spread within a run beside the spread between runs. A 2-GPU kind.
job_sdxl_repeat() {
    local S="python3 bench/scaling.py --skip-llm --skip-wan --stacks toolkit --timeout 300 --sdxl-warmup 5 --sdxl-steps 60 --work /tmp/w-sdxl"
    for i in 1 2 3; do
        CUDA_VISIBLE_DEVICES=0 $S --gpus 1 --counts 1 --out $R/sdxl-rep-1-$i.json > $R/sdxl-rep-1-$i.txt 2>&1
        $S --gpus 2 --counts 2 --out $R/sdxl-rep-2-$i.json > $R/sdxl-rep-2-$i.txt 2>&1
    done
    # the GPU's busy time per step beside the wall time, three fresh processes: kernels that run slower in one
    # process (another cuDNN or GEMM choice) or the GPU waiting on the host
    local W=/tmp/w-sdxl
    for i in 1 2 3; do
        CUDA_VISIBLE_DEVICES=0 python3 bench/profile_steps.py $W/sdxl-toolkit.yaml model.name_or_path=$W/sdxl \
            data.path=$W/images data.resolution=1024 train.batch_size=2 train.compile=true \
            run.output_dir=/tmp/sdxl-prof-$i --after 10 --steps 10 --rows 15 > $R/sdxl-profile-$i.txt 2>&1
    done
}
# two single-GPU jobs side by side on a 2-GPU kind (issue 39's sd15 loss parity; issue 40's LTX-2, then
# HunyuanVideo 1.5): each on a GPU of its own
job_pair() {
    ( export CUDA_VISIBLE_DEVICES=0; job_parity_sd15 ) &
    ( export CUDA_VISIBLE_DEVICES=1; job_ltx2; echo "$(date +%T) ltx2 done" >> $R/queue.log; job_hunyuan15 ) &
    wait
}
