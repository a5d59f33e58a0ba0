"""Signed, hash-linked run receipts: what a run used and made (toolkit/receipts/chain.py), signed by
the site's signer while the run's job runs (signer.py, with the key of keys.py), checked by
`ft receipt verify` (verify.py)."""
