from kvstore.base import ResidencyMeter


def test_each_sample_holds_until_the_next() -> None:
    meter = ResidencyMeter(bytes_per_page=100, now=10.0)
    meter.sample({"acme": {"device": 3}}, now=10.0)
    meter.sample({"acme": {"device": 1, "host": 4}, "beta": {"disk": 2}}, now=12.0)
    assert meter.byte_seconds == {"acme": {"device": 600.0}}  # 3 pages x 100 B x 2 s
    meter.sample({}, now=13.5)
    assert meter.byte_seconds == {
        "acme": {"device": 750.0, "host": 600.0},
        "beta": {"disk": 300.0},
    }
    meter.sample({"acme": {"device": 5}}, now=20.0)  # nothing was held in between
    assert meter.byte_seconds["acme"]["device"] == 750.0
    assert meter.since_sample(21.0) == 1.0


def test_empty_tiers_and_a_clock_going_back_charge_nothing() -> None:
    meter = ResidencyMeter(bytes_per_page=8, now=5.0)
    meter.sample({"acme": {"device": 0, "host": 2}}, now=5.0)
    meter.sample({"acme": {"host": 2}}, now=4.0)  # an earlier time: no negative charge
    assert meter.byte_seconds == {}
    meter.sample({}, now=6.0)
    assert meter.byte_seconds == {"acme": {"host": 16.0}}
