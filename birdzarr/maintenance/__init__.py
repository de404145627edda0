"""Keeping stores sound: verify (checksums, missing chunks, sources), repair (what a killed run
left behind) and copy (resumable, verified, committed last)."""
