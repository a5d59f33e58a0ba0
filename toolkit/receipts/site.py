"""The monitoring and signing part of a cluster profile (toolkit/cluster/profile.py): the site's
receipt signer (the key `ft receipt verify` checks with, the socket a job asks on, its ledger), and
whether compute nodes reach the internet (W&B online, or offline and synced from the login node).
Standard library and pydantic only: every `ft` command loads the profile."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from toolkit.base.digests import key_id, public_key_bytes


class ReceiptSigning(BaseModel):
    """The site's receipt signer (ansible/roles/ft_signer writes this section): the key `ft receipt
    verify` checks signatures with, and the socket a job asks for one on (toolkit/receipts)."""
    model_config = ConfigDict(extra="forbid")
    public_key: str  # base64 of the raw 32-byte ed25519 public key
    key_id: str  # the first 16 hex digits of its sha256: what a signature names
    socket: str = "/run/ft-signer/receipt.sock"
    # What the signers signed, per user and run, on the shared filesystem (None: not known here):
    # verify finds a receipt cut back to an earlier seal there.
    ledger: str | None = None

    @model_validator(mode="after")
    def key_id_is_the_key_s(self) -> ReceiptSigning:
        wanted = key_id(public_key_bytes(self.public_key))  # ValueError: not a public key
        if self.key_id != wanted:
            raise ValueError(f"key_id {self.key_id!r} is not this public key's ({wanted}): copy both from the "
                             "signer's key (python -m toolkit.receipts.keys KEYFILE)")
        return self

    @field_validator("socket", "ledger")
    @classmethod
    def socket_path(cls, value: str | None) -> str | None:
        if value is not None and (not value.startswith("/") or any(ch in value for ch in "\n\r\0")):
            raise ValueError(f"{value!r}: the signer's socket and ledger are absolute paths on one line")
        return value


class MonitoringSite(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # Whether compute nodes reach the internet. Without (the lab, air-gapped sites), W&B logs offline
    # and is synced from the login node (`wandb sync`), and `ft doctor` probes no public endpoint.
    compute_internet: bool = True
    # The site's receipt signer; None: runs' receipts stay unsigned (`ft receipt verify` says so).
    receipts: ReceiptSigning | None = None
