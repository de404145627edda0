"""Keeping stores sound: verify (checksums, missing chunks, sources), repair (what a killed run
left behind) and copy (resumable, verified, committed last); and subset (a selection of a
store's windows written as its own store, committed last)."""
