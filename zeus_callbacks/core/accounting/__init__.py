"""Per-job energy accounting: the job as its scheduler names it, and the ledger jobs append to."""
