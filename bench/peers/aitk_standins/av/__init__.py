"""Stand-in for PyAV in the bench's ai-toolkit rows, last on the peer's PYTHONPATH. ai-toolkit imports `av` at the
top of modules every job loads (toolkit/audio/album_artwork.py, toolkit/data_transfer_object/data_loader.py) but
calls it only for audio models; PyAV's wheel (40 MB) does not fit what a device call carries. Any use fails."""


def __getattr__(name: str):
    raise AttributeError(f"av.{name}: PyAV is not installed for the bench's ai-toolkit rows (audio models only)")
