"""The update journal: versions in order, the last `keep` in memory, every one on disk (atomically), what a catch-up
can replay (none when one is missing), pruning past a full load's bytes, and a resumed run's id and version."""

from lightning_logra.paths import model_folder, vocab_size
from lightning_logra.rollout.journal import UpdateJournal


def test_versions_memory_and_disk(tmp_path):
    journal = UpdateJournal(keep=2, directory=tmp_path)
    for i in range(1, 5):
        assert journal.record(bytes([i]) * 10) == i
    assert journal.version == 4 and list(journal._memory) == [3, 4]  # the last two in memory
    files = sorted(p.name for p in (tmp_path / journal.run).iterdir())
    assert files == [f"00000000{i}.update" for i in range(1, 5)]  # every one on disk, none half-written
    assert journal.since(1) == [bytes([2]) * 10, bytes([3]) * 10, bytes([4]) * 10]  # 2 from disk, 2 from memory
    assert journal.since(4) == [] and journal.since(5) is None and journal.since(-1) is None


def test_memory_only_forgets_and_says_so():
    journal = UpdateJournal(keep=2)
    for i in range(1, 5):
        journal.record(bytes([i]))
    assert journal.since(2) == [bytes([3]), bytes([4])]
    assert journal.since(1) is None  # update 2 is no longer kept: a full load is the way back


def test_a_rank_that_does_not_send_counts_without_keeping():
    journal = UpdateJournal(keep=2)
    journal.record(b"x", write=False)
    assert journal.version == 1 and journal.since(0) is None


def test_prune_keeps_what_replays_cheaper_than_a_full_load(tmp_path):
    journal = UpdateJournal(keep=1, directory=tmp_path)
    for _ in range(5):
        journal.record(bytes(100))
    journal.prune(full_load_bytes=250)  # replaying 3 updates (300 bytes) costs more than the load: 4 and 5 stay
    assert sorted(p.name for p in (tmp_path / journal.run).iterdir()) == ["000000004.update", "000000005.update"]
    assert journal.since(3) == [bytes(100), bytes(100)] and journal.since(2) is None


def test_a_full_load_of_unknown_size_prunes_nothing_and_a_hub_models_size_is_found_in_the_cache(tmp_path,
                                                                                               monkeypatch):
    # A hub id's size was taken as 0 (its files are not a folder given), and every update was pruned as it was
    # written: every catch-up became a full load (15 GB at 7B).
    journal = UpdateJournal(keep=1, directory=tmp_path)
    for _ in range(3):
        journal.record(bytes(100))
    journal.prune(full_load_bytes=0)
    assert len(list((tmp_path / journal.run).iterdir())) == 3
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    (snapshot / "model.safetensors").write_bytes(bytes(1234))
    (snapshot / "config.json").write_text('{"vocab_size": 151936}')
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, local_files_only: str(snapshot))
    assert model_folder("Qwen/Qwen2.5-1.5B-Instruct") == snapshot and vocab_size(snapshot) == 151936


def test_a_resumed_run_takes_its_checkpoints_id_and_version(tmp_path):
    first = UpdateJournal(directory=tmp_path)
    first.record(b"a")
    first.record(b"b")
    resumed = UpdateJournal(directory=tmp_path)
    assert resumed.run != first.run  # a new run has an id of its own
    resumed.restore(first.state())
    assert resumed.state() == {"run": first.run, "version": 2}
    assert resumed.since(0) == [b"a", b"b"]  # from disk: memory starts empty
    resumed.record(b"c")  # overwrites nothing it should not: the next version
    assert resumed.since(2) == [b"c"]
