"""`eaglewire demo` never deletes a directory it did not make."""

from eaglewire.cli import main


def test_demo_refuses_a_directory_it_did_not_make(tmp_path, capsys):
    keep = tmp_path / "mine"
    keep.mkdir()
    (keep / "notes.txt").write_text("precious")
    assert main(["demo", "--out", str(keep)]) == 1
    assert "was not made by `eaglewire demo`" in capsys.readouterr().err
    assert (keep / "notes.txt").read_text() == "precious"
