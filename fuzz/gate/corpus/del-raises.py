class D:
    def __del__(self, *a, **k):
        'x'[5]
d = D()
del d
REPLY = {'body': 1}
