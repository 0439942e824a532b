# ostris/ai-toolkit for bench/peers/aitk.py (built by bench/peers/packages.sh aitk).
GITHUB=ostris/ai-toolkit
COMMIT=27a03a91f23eb1b757d5ec2e80ee3e129cfcc350
# the source without its web UI, assets and keymap checkpoints (the mirror lacks one of them; only SD checkpoint
# conversion reads them)
EXCLUDE=('toolkit/keymaps/*.safetensors' ui assets notebooks docker)
# What `python run.py job.yaml` imports for flux, qwen_image and wan21 beyond the GPU machine's image (found by running
# it on the CPU with only the image's packages: every extension module is imported at start-up). Its requirements
# pin diffusers at a git commit (adopted 2026-07-15, after 0.39.0 of 2026-07-03): 0.40.0 (2026-08-20) is the first
# release after it. Its transformers 5.5.3 lacks Gemma4Unified..., which diffusers 0.40's LTX-2 pipeline (imported at
# start-up) needs: the machine's transformers 5.17 and tokenizers serve instead. torchvision, torchaudio, timm,
# scikit-image, opencv: the machine's. Left out: bitsandbytes (the examples' adamw8bit: torch adamw instead) and
# PyAV (40 MB; imported, never called, for these models: bench/peers/standins/av).
WHEELS=(
    diffusers==0.40.0 huggingface_hub==1.23.0 peft==0.18.1
    optimum-quanto==0.2.4 torchao==0.10.0
    albumentations==1.4.15 albucore==0.0.16 pydantic==2.12.5 pydantic_core==2.41.5 annotated_types typing_inspection
    controlnet_aux==0.0.10 lpips open_clip_torch ftfy wcwidth
    oyaml python-dotenv flatten_json
)
SDISTS=(lycoris-lora==1.8.3)  # its pinned version has no wheel on PyPI
