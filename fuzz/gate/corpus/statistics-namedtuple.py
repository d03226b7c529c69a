import statistics
P = statistics.namedtuple('P', 'a b')
REPLY = P(1, 2)
