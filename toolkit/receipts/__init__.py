"""Signed, hash-linked run receipts: what a run used and made (chain.py, in the one JSON form of
canonical.py), sealed by the site's signer while the run's job runs (signing.py asks it; the signer
itself is a site daemon, toolkit/services/signer.py, with the key of keys.py and its ledger.py),
checked by `ft receipt verify` (verify.py)."""
