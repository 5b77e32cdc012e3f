"""The hang watchdog: a rank that stops making progress is an incident with every rank's
stack (:mod:`.watchdog`, the core; :mod:`.adapter`, its hooks in Megatron's loop)."""
