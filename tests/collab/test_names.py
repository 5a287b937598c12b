"""The shared names (ciar.collab.names) are the ones the decoder, the network model and the CLI use."""

from ciar.collab import names
from ciar.sim import decoder
from ciar.sim.network import PROFILES, get_profile


def test_networks_are_the_profiles():
    assert tuple(PROFILES) == names.NETWORKS
    for n in names.NETWORKS:
        assert get_profile(n).name == n


def test_methods_are_the_presets():
    assert decoder.METHODS is names.METHODS
    for m in names.METHODS:
        assert decoder.method_config(m).method == m


def test_cli_offers_the_same_methods():
    from ciar.generate import build_parser

    action = next(a for a in build_parser()._actions if a.dest == "method")
    assert tuple(action.choices) == names.METHODS
