"""Stand-in for PyAV in the bench's ai-toolkit and musubi-tuner rows, last on the peer's PYTHONPATH. ai-toolkit
imports `av` at the top of modules every job loads (toolkit/audio/album_artwork.py,
toolkit/data_transfer_object/data_loader.py) but calls it only for audio models; musubi-tuner imports it at the top of
dataset/media_utils.py but calls it only to decode video containers, and the bench hands it the clip as a folder of
frames. PyAV's wheel (40 MB) does not fit what a device call carries beside the peers. Any use fails."""


def __getattr__(name: str):
    raise AttributeError(f"av.{name}: PyAV is not installed for the bench's peer rows (ai-toolkit's audio models, musubi-tuner's video containers)")
