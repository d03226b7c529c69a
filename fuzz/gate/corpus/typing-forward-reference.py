import typing
T = typing.Optional['__import__("os").system("id")']
D = typing.List['x'].copy_with(('y',))
REPLY = {'body': str(T)}
