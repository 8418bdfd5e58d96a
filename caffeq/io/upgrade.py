"""Legacy format upgrade (placeholder until the full module lands)."""


def upgrade_net(net, source="", weights=None):
    return []
