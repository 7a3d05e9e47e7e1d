"""The fault suite (issue 14): hostile input, crashes, lost services, the disk, hostile clients, secrets at rest."""
