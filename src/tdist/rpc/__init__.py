"""tdist.rpc (facade filled in by the RPC agent work)."""
