"""``python -m cluster down`` cleans up what ``up`` wrote, Ray's current-cluster file included."""

from __future__ import annotations

from cluster import local


def test_down_forgets_only_its_own_head(tmp_path, monkeypatch):
    f = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(local, "ray_address_file", lambda: f)
    monkeypatch.setattr(local, "state_dir", lambda: tmp_path)
    f.write_text("127.0.0.1:6390")   # another head, started after ours
    assert not local.forget_ray_address("127.0.0.1:6379") and f.exists()
    # a state file as `up` writes it for a head it started (pid 0: nothing to signal)
    local.write_json(local.state_file(8123), {"port": 8123, "started_ray": True, "ray_pid": None,
                                              "address": "127.0.0.1:6379"})
    f.write_text("127.0.0.1:6379\n")
    assert local.down(8123) is True
    assert not f.exists() and not local.state_file(8123).exists()
    assert local.down(8123) is False   # nothing recorded any more


def test_down_forgets_its_head_under_the_hosts_own_address(tmp_path, monkeypatch):
    """Ray records the host's address in its file even for a head started on 127.0.0.1
    (a newcomer found the file left behind): the same port on an address of this machine
    is our head; the same port on another machine's address is not."""
    import psutil

    f = tmp_path / "ray_current_cluster"
    monkeypatch.setattr(local, "ray_address_file", lambda: f)
    v4 = [a.address for addrs in psutil.net_if_addrs().values() for a in addrs
          if a.family.name == "AF_INET"]
    own = next((a for a in v4 if not a.startswith("127.")), "127.0.0.1")   # the host's own
    f.write_text("203.0.113.9:6379\n")            # a documentation address: not this machine
    assert not local.forget_ray_address("127.0.0.1:6379") and f.exists()
    f.write_text(f"{own}:6379\n")
    assert local.forget_ray_address("127.0.0.1:6379") and not f.exists()
