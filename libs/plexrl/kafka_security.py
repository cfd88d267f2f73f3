"""How the services authenticate to Kafka and encrypt what they send it: a rule of its
own, so that the settings can check it without importing the Kafka client."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

Protocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
Mechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]


@dataclass(frozen=True)
class KafkaSecurity:
    """What every Kafka client of a service (producer, consumers, admin) speaks to the
    brokers (settings `PLEXRL_KAFKA_SECURITY_PROTOCOL`, `PLEXRL_KAFKA_SSL_*`,
    `PLEXRL_KAFKA_SASL_*`; docs/deploy.md)."""

    protocol: Protocol = "PLAINTEXT"
    """The broker listener's `security.protocol`: PLAINTEXT on one machine or a private
    network; SSL (TLS, optionally with a client certificate) or SASL_SSL (TLS plus a
    user and password) across a shared one."""
    cafile: str | None = None
    """PEM file of the CA that signed the brokers' certificates (None: the system's)."""
    certfile: str | None = None
    """PEM file of this client's certificate, for brokers that require one
    (`ssl.client.auth=required`); with `keyfile`."""
    keyfile: str | None = None
    """PEM file of that certificate's private key (unencrypted)."""
    check_hostname: bool = True
    """Whether a broker's certificate must name the address it is reached at."""
    sasl_mechanism: Mechanism | None = None
    """The SASL mechanism of a SASL_* listener."""
    sasl_username: str | None = None
    sasl_password: str | None = None

    def __post_init__(self) -> None:
        tls = self.protocol in ("SSL", "SASL_SSL")
        sasl = self.protocol.startswith("SASL_")
        if (self.certfile is None) != (self.keyfile is None):
            raise ValueError(
                "a Kafka client certificate needs both PLEXRL_KAFKA_SSL_CERTFILE and "
                "PLEXRL_KAFKA_SSL_KEYFILE (or neither)"
            )
        if not tls and (self.cafile or self.certfile):
            raise ValueError(
                f"PLEXRL_KAFKA_SSL_* files are set but PLEXRL_KAFKA_SECURITY_PROTOCOL is "
                f"{self.protocol}; set it to SSL or SASL_SSL to use them"
            )
        files = (("CAFILE", self.cafile), ("CERTFILE", self.certfile), ("KEYFILE", self.keyfile))
        for name, path in files:
            if path is not None and not Path(path).is_file():
                raise ValueError(f"PLEXRL_KAFKA_SSL_{name} {path} is not a file")
        if sasl and not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
            raise ValueError(
                f"PLEXRL_KAFKA_SECURITY_PROTOCOL={self.protocol} needs "
                "PLEXRL_KAFKA_SASL_MECHANISM, PLEXRL_KAFKA_SASL_USERNAME and "
                "PLEXRL_KAFKA_SASL_PASSWORD"
            )
        if not sasl and self.sasl_mechanism:
            raise ValueError(
                f"PLEXRL_KAFKA_SASL_MECHANISM is set but PLEXRL_KAFKA_SECURITY_PROTOCOL is "
                f"{self.protocol}; set it to SASL_SSL (or SASL_PLAINTEXT)"
            )

    def client_options(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's producer, consumer and admin client."""
        options: dict[str, Any] = {"security_protocol": self.protocol}
        if self.protocol in ("SSL", "SASL_SSL"):
            context = ssl.create_default_context(cafile=self.cafile)
            context.check_hostname = self.check_hostname
            if self.certfile is not None:
                context.load_cert_chain(self.certfile, self.keyfile)
            options["ssl_context"] = context
        if self.sasl_mechanism is not None:
            options.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        return options


PLAINTEXT = KafkaSecurity()
"""No TLS, no authentication: one machine, or a private network."""
