# ostris/ai-toolkit for bench/peers/aitk.py (built by bench/peers/packages.sh aitk).
GITHUB=ostris/ai-toolkit
COMMIT=27a03a91f23eb1b757d5ec2e80ee3e129cfcc350
# run.py's training path (jobs/, toolkit/, extensions_built_in/) without the UI, assets or the keymap checkpoints
# (the mirror lacks one of them; only SD checkpoint conversion reads them)
PATHS=(run.py version.py info.py LICENSE README.md toolkit jobs extensions extensions_built_in config
       ':!toolkit/keymaps/*.safetensors')
WHEELS=(
    diffusers==0.40.0            # its requirements pin a diffusers git commit (2026-07); 0.40.0 is the first release after
    huggingface_hub==1.23.0 peft==0.18.1  # transformers: the machine's 5.17 (diffusers 0.40 needs newer than its 5.5.3)
    oyaml python-dotenv flatten_json toml
    optimum-quanto==0.2.4
)
