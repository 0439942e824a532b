"""The diffusion trainers bench/diffusion.py measures beside the toolkit: row prefix -> module (imported lazily),
each with KINDS, row(...) and parity(...) (bench/peers/common.py says what they share)."""

PEERS = {"kohya": "peers.kohya", "musubi": "peers.musubi", "aitk": "peers.aitk"}
