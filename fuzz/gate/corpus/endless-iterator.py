import itertools as e
s = e.count()
f = [[] for a in s]
