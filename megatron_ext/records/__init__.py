"""The record core: the append-only logs (signals, spike ledger) as writers and readers see them."""
