"""The digest a worker reports for its remote tier's store: one store's URLs match whatever
credentials they carry; other stores do not."""

from kvstore.remote import store_id


def test_credentials_do_not_change_the_id():
    assert store_id("redis://:secret@kv.internal:6379/0") == store_id("redis://kv.internal:6379/0")
    assert store_id("redis://user:a@kv:6379/") == store_id("redis://user:b@kv:6379/0")


def test_another_host_port_database_or_socket_is_another_store():
    base = store_id("redis://kv:6379/0")
    others = ["redis://kv2:6379/0", "redis://kv:6380/0", "redis://kv:6379/1", "rediss://kv:6379/0"]
    assert all(store_id(url) != base for url in others)
    assert store_id("unix:///run/a.sock") != store_id("unix:///run/b.sock")
