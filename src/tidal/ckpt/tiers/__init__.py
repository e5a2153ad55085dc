"""Where steps live: the Tier protocols, directories (shm, disk), S3, peer memory, upload queues,
and tier specs."""
