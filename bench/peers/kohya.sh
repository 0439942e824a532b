# kohya-ss/sd-scripts for bench/peers/kohya.py (bench/peers/packages.sh kohya). Its requirements.txt pins
# transformers 4.54.1, diffusers 0.32.1, accelerate 1.6.0, huggingface-hub 0.34.3: those travel
# as wheels, with what the GPU image lacks (toml, voluptuous, imagesize, ftfy, importlib_metadata for diffusers).
# Its safetensors pin (0.4.5) is left to the machine's newer one (no abi3 wheel). Left out: bitsandbytes, opencv, the optional optimizers (the rows use torch's AdamW), and the Windows DLLs and
# a Qwen3 tokenizer the mirror does not hold (no row reads them).
GITHUB=kohya-ss/sd-scripts
COMMIT=48d368fa557731ad0488c07304dfeba8c07910eb
WHEELS=(transformers==4.54.1 "tokenizers>=0.21,<0.22" diffusers==0.32.1 accelerate==1.6.0 huggingface-hub==0.34.3
        toml==0.10.2 voluptuous==0.15.2 imagesize==1.4.1 ftfy==6.3.1 wcwidth importlib_metadata zipp)
EXCLUDE=(bitsandbytes_windows configs/qwen3_06b/tokenizer.json)
