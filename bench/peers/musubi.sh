# kohya-ss/musubi-tuner pins for bench/peers/packages.sh (bench/peers/musubi.py): its pyproject.toml's versions of
# what the GPU machine's image lacks or has in another major version. Left out: torch (the machine's), opencv (the
# machine has opencv-python-headless), av (35 MB; the clip is handed over as a folder of frames, which musubi reads
# with PIL: bench/peers/musubi.py puts a module in place of av that fails if ever called), bitsandbytes (not used:
# --optimizer_type adamw), sentencepiece (the machine's; the bench's tokenizers are fast tokenizers).
GITHUB=kohya-ss/musubi-tuner
COMMIT=30c658c4f4b0bf05038b3346eff9670259b10fc7
WHEELS=(transformers==4.57.6 "tokenizers>=0.22,<0.23" huggingface-hub==0.34.3 accelerate==1.6.0 diffusers==0.32.1
        easydict==1.13 voluptuous==0.15.2 toml==0.10.2 ftfy==6.3.1 wcwidth tqdm==4.67.1 einops==0.7.0)
