"""The prepared pre-training comparison's corpus (issue 48): deduplicated, split and digested by content."""

from __future__ import annotations

from pathlib import Path

from benchmarks.gpu import pretrain_data


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_corpus_is_one_file_per_content_and_its_digest_names_contents_not_paths(tmp_path, monkeypatch):
    monkeypatch.setattr(pretrain_data, "MAX_FILE_BYTES", 100)
    one = tmp_path / "one"
    write(one / "a" / "x.py", b"print(1)\n")
    write(one / "b" / "copy.py", b"print(1)\n")
    target = write(one / "c" / "z.py", b"def f():\n    return 2\n")
    (one / "link.py").symlink_to(target)
    write(one / "latin1.py", "café = 1\n".encode("latin-1"))
    write(one / "big.py", b"x = 1\n" * 40)
    write(one / "notes.txt", b"not python\n")
    sources, left_out = pretrain_data.collect([one])
    assert sorted(s.text for s in sources) == ["def f():\n    return 2\n", "print(1)\n"]
    assert [s.sha for s in sources] == sorted(s.sha for s in sources)
    assert left_out == {"duplicates": 1, "links": 1, "too_large": 1, "not_utf8": 1}

    other = tmp_path / "other"  # the same contents under other names and folders: the same corpus
    write(other / "renamed.py", b"def f():\n    return 2\n")
    write(other / "deep" / "er" / "p.py", b"print(1)\n")
    again, _ = pretrain_data.collect([other])
    assert pretrain_data.corpus_digest(again, 0.5) == pretrain_data.corpus_digest(sources, 0.5)
    assert pretrain_data.corpus_digest(sources, 1.0) != pretrain_data.corpus_digest(sources, 0.0)
    assert [s.held_out(0.0) for s in sources] == [False, False]
    assert [s.held_out(1.0) for s in sources] == [True, True]


def test_installation_roots_are_walked_once():
    roots = pretrain_data.installation_roots()
    assert roots and all(root.is_dir() for root in roots)
    assert not any(other in root.parents for root in roots for other in roots)
