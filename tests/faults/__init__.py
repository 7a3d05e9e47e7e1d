"""The fault suite: hostile input, crashes, lost services, exhausted resources."""
