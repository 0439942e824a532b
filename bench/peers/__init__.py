"""The peer trainers of bench/diffusion.py's rows: row prefix -> module (imported when a row needs it)."""

PEERS = {"kohya": "peers.kohya", "musubi": "peers.musubi", "aitk": "peers.aitk"}
