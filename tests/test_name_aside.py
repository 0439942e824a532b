"""name_aside: an earlier final/ or run folder set aside under a name no other one holds, even within one second."""

from toolkit.train.run_dir import name_aside


def test_names_set_aside_in_one_second_do_not_collide(tmp_path, monkeypatch):
    import toolkit.train.run_dir as run_dir

    monkeypatch.setattr(run_dir.time, "strftime", lambda fmt: "20261129-023223")
    final = tmp_path / "final"
    names = []
    for n in range(3):  # three exports of an extended run within the same second
        final.mkdir()
        (final / "lora.safetensors").write_text(str(n))
        target = name_aside(final, "replaced")
        final.rename(target)
        names.append(target.name)
    assert names == ["final.replaced-20261129-023223", "final.replaced-20261129-023223-1",
                     "final.replaced-20261129-023223-2"]
    assert [(tmp_path / name / "lora.safetensors").read_text() for name in names] == ["0", "1", "2"]
